#!/bin/bash
# run.sh NAME PID CMD... : runs CMD (a load generator), prints NAME, its summary line and the PID's CPU seconds per request
name=$1; pid=$2; shift 2
c0=$(/tmp/h2bench/cpu.sh $pid)
out=$("$@" 2>&1)
c1=$(/tmp/h2bench/cpu.sh $pid)
reqs=$(echo "$out" | grep -oE '^requests: [0-9]+ total' | grep -oE '[0-9]+' | head -1)
[ -z "$reqs" ] && reqs=$(echo "$out" | grep -oE '[0-9]+ requests in' | grep -oE '^[0-9]+')
rps=$(echo "$out" | grep -oE 'finished in [0-9.]+s, [0-9.]+ req/s|Requests/sec: +[0-9.]+')
fails=$(echo "$out" | grep -oE '[0-9]+ succeeded, [0-9]+ failed, [0-9]+ errored|Non-2xx.*|Socket errors.*')
echo "$name: $rps; $reqs requests; ${fails:-no errors}; proxy CPU $(python3 -c "print(f'{($c1-$c0)/$reqs*1e6:.0f} us/request')")"
