"""Load-test tooling: our open-loop constant-rate generator (loadgen), the wrk2 Lua scripts, and a
parser (report) that reads wrk2's output and ours into one shape."""
