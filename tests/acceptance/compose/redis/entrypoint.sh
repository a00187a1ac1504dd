#!/bin/sh
set -eu
if [ "${1:-}" = "redis-server" ]; then
  chown -R redis:redis /data
  exec gosu redis "$@" --protected-mode no
fi
exec "$@"
