#!/bin/bash
# usage: [NOLIMIT=1] count.sh CHECKOUT -> callgrind instructions per Pipeline.limit() call (micro.py, 20k vs 40k calls)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$1" && pwd)
PY=$(python3 -c 'import sys; print(sys.executable)')  # the interpreter itself, not a pyenv shim
r() { ROOT=$root PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null "$PY" "$here/micro.py" "$1" 2>&1 | grep -o "Collected : [0-9]*" | grep -o "[0-9]*"; }
a=$(r 20000); b=$(r 40000)
echo "$(( (b - a) / 20000 )) instructions/limit()  ($root ${NOLIMIT:+no-limit})"
