"""The schedules room: what each optimizer step trains on, at which rate, and how often ranks synchronise.

``recipe`` (the large-batch recipe: optimizer, warm-up and cosine over clips seen), ``multigrid``,
``batch_growth``, ``model_averaging`` (K-step averaging) and ``regime``, the one place that knows which of
them combine. Imports the data room (``EpochShapes``) and nothing above it.
"""
