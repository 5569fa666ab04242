#!/bin/sh
# Horovod Elastic host discovery: print the hosts of a hosts file, one "host:slots" per line.
#
#   horovodrun --host-discovery-script "scripts/discover-hosts.sh hosts.txt" --min-np 2 --max-np 8 ...
#
# horovodrun runs this every second; editing the file adds or removes hosts from the running job
# (a removed host's ranks stop at the next commit; an added one joins there). Blank lines and
# '#' comments are skipped. On one machine, list each slot as its own name for 127.0.0.1
# (localhost:1, 127.0.0.1:1, 127.1:1, 127.0.1:1): Horovod blacklists a whole name when one of its
# ranks dies (docs/elastic.md).
hosts=${1:-hosts.txt}
if [ ! -r "$hosts" ]; then
    echo "discover-hosts.sh: cannot read hosts file $hosts" >&2
    exit 1
fi
sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d' "$hosts"
