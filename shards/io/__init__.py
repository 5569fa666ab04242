"""Where bytes come from, on the base alone: paths and URLs, atomic writes, free room (``storage``,
which loads no HTTP client), and the HTTP range client with its outage policy (``http_range``)."""
