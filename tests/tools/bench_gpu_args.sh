#!/usr/bin/env bash
# bench gpu refuses malformed --layouts and --big-gpu-free with its usage (exit 64) before it
# looks for a device, so this runs on any host; well-formed values would start the benchmark,
# so only the refusals are checked.
set -u
bin=$1
fail=0
for args in "--layouts 2x" "--layouts x2" "--layouts 0x2" "--layouts 2x65" "--layouts 2x2," \
    "--layouts 2x2x2" "--layouts 1x1,1x2,1x3,1x4,2x1,2x2,2x3" "--layouts" \
    "--big-gpu-free 0" "--big-gpu-free 12Q" "--big-gpu-free"; do
    # shellcheck disable=SC2086 # the words of $args are the arguments
    timeout 20 "$bin" $args >/dev/null 2>&1
    rc=$?
    if [ $rc -ne 64 ]; then
        echo "bench_gpu $args: exit $rc, want 64 (usage)" >&2
        fail=1
    fi
done
exit $fail
