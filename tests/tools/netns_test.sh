#!/usr/bin/env bash
# tests/tools/netns_test.sh: `ember train` across hosts, with network namespaces as the hosts.
#
# Five namespaces on this machine: a "switch" (one bridge) and four hosts wired to it by veth
# pairs, 10.77.0.0/24:
#
#   host h0 10.77.0.10  ps 0        host h2 10.77.0.20  worker 0
#   host h1 10.77.0.11  ps 1        host h3 10.77.0.21  worker 1
#
# One cluster file in tools/launch's style ([cluster] ps = URL,URL / workers = 2) drives one
# `ember train --cluster FILE --role ps|worker --index I` per role, each started with
# `ip netns exec HOST` under `timeout`. The same 2 PS x 2 worker synchronous job (staleness 0)
# runs three times: on loopback in a namespace of its own (tools/launch --transport tcp, the
# reference), across the hosts over tcp://, and across them over tls+tcp:// (a test CA; every
# process presents a certificate it signed, [cluster] tls_cert/tls_key/tls_ca).
#
# Each cross-host job must: exit 0 in all four processes, on their own (worker 0 shuts the PS
# down); print worker 0's JSON with test AUC > 0.60 (a job that did not train gets ~0.51), the
# same steps/rows/eval_rows as the loopback job and an AUC within 0.02 of it (two workers are
# not bit-for-bit repeatable: loopback runs spread over ~0.005); leave a final checkpoint
# holding both PS shards; show TCP connections from both worker hosts on both PS ports (ss,
# sampled while the job runs plus TIME-WAIT afterwards); and move at least 4 MiB each way
# through each PS host's interface (a full job moves ~8 MiB through h1, ~170 MiB through h0,
# which holds the dense tower; a 2-step job under 1 MiB).
#
# Privileges: as root the test works in a private mount namespace (unshare -m) with a tmpfs on
# /run/netns, so the namespaces disappear with the test even if it is SIGKILLed; not root (or
# root without CAP_SYS_ADMIN), it tries an unprivileged user + net + mount namespace
# (unshare -Urnm) the same way. Neither possible: exit 77 (SKIPPED under ctest). Namespace
# names carry the PID; an EXIT trap stops every process and deletes every namespace on every
# exit path. Every ember process runs under timeout(1).
#
# Environment: EMBER_BIN (ember binary), EMBER_TEST_TMP (scratch parent, default $TMPDIR),
# NETNS_TEST_JOB_TIMEOUT (seconds per job, default 60), NETNS_TEST_KEEP=1 keeps the scratch
# directory.
set -uo pipefail

SKIP=77
me="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
root="$(cd "$(dirname "$0")/../.." && pwd)"
launch="$root/tools/launch"
ember="${EMBER_BIN:-$root/build/ember}"
job_limit="${NETNS_TEST_JOB_TIMEOUT:-60}"

say() { echo "netns_test: $*" >&2; }
skip() { say "SKIPPED: $*"; exit "$SKIP"; }

# ---- outer: pick how to get CAP_NET_ADMIN, then re-run this script as the inner part ----
if [ "${1:-}" != --inner ]; then
    for t in ip timeout openssl ss awk unshare; do
        command -v "$t" >/dev/null 2>&1 || skip "needs '$t' (iproute2, coreutils, openssl, util-linux)"
    done
    [ -x "$ember" ] || { say "no ember binary at '$ember' (set EMBER_BIN)"; exit 2; }
    [ -x "$launch" ] || { say "no tools/launch at '$launch'"; exit 2; }
    if [ "$(id -u)" = 0 ] && unshare -m --propagation private true 2>/dev/null; then
        exec unshare -m --propagation private -- bash "$me" --inner private
    fi
    if unshare -Urnm --propagation private true 2>/dev/null; then
        exec unshare -Urnm --propagation private -- bash "$me" --inner private
    fi
    # Root that cannot make a mount namespace: ip netns in the machine's own (it will most
    # likely lack the privileges for that too, and skip below).
    [ "$(id -u)" = 0 ] && exec bash "$me" --inner root
    skip "needs CAP_NET_ADMIN for network namespaces: not root, and an unprivileged user" \
        "namespace (unshare -Urnm) is not allowed here (user.max_user_namespaces," \
        "kernel.unprivileged_userns_clone or an AppArmor/seccomp policy)"
fi
mode="${2:-root}"

# ---- inner: from here on everything started is stopped and every namespace deleted ----
pfx="ember-nt-$$"
declare -a namespaces=() pids=() names=()
scratch=""
failures=0

stop_pids() { # TERM every process we started (each timeout(1) leads its own group), then KILL
    local p t alive
    for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null; done
    for t in $(seq 1 50); do
        alive=0
        for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && break
        sleep 0.1
    done
    for p in "${pids[@]}"; do kill -KILL -- "-$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
    pids=() names=()
}

cleanup() {
    local ns p i
    trap - EXIT INT TERM HUP
    stop_pids
    # Anything still inside our namespaces was started by this test: kill it by pid.
    for ns in "${namespaces[@]}"; do
        for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
    done
    for ((i = ${#namespaces[@]} - 1; i >= 0; i--)); do ip netns del "${namespaces[$i]}" 2>/dev/null; done
    if [ -n "$scratch" ] && [ "${NETNS_TEST_KEEP:-0}" != 1 ] && [ "$failures" = 0 ]; then
        rm -rf "$scratch"
    fi
}
trap cleanup EXIT
trap 'say "interrupted"; exit 130' INT
trap 'say "terminated"; exit 143' TERM
trap 'say "hung up"; exit 129' HUP

check() { # check STATUS DESCRIPTION... (STATUS: $? of the test just run); a failure is counted,
    # the test goes on
    if [ "$1" = 0 ]; then
        say "ok: ${*:2}"
    else
        say "FAILED: ${*:2}"
        failures=$((failures + 1))
    fi
}
die() { say "FAILED: $*"; failures=$((failures + 1)); exit 1; }

if [ "$mode" = private ]; then
    # Our own /run/netns: nothing is left on the machine when this mount namespace goes away.
    if [ -d /run/netns ] || mkdir -p /run/netns 2>/dev/null; then
        mount -t tmpfs -o mode=0755,size=1m ember-netns /run/netns || skip "cannot mount a tmpfs on /run/netns"
    else
        { mount -t tmpfs -o mode=0755,size=1m ember-run /run && mkdir /run/netns; } ||
            skip "cannot mount a tmpfs on /run"
    fi
else
    # Leftovers of runs that were SIGKILLed (their PID is gone).
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^ember-nt-[0-9]+-'); do
        owner="${ns#ember-nt-}"
        owner="${owner%%-*}"
        kill -0 "$owner" 2>/dev/null || ip netns del "$ns" 2>/dev/null
    done
fi

add_ns() {
    ip netns add "$1" || return 1
    namespaces+=("$1")
    ip -n "$1" link set lo up
}
add_ns "$pfx-probe" 2>/dev/null || skip "cannot create a network namespace (ip netns add: no CAP_NET_ADMIN?)"
ip -n "$pfx-probe" link add br0 type bridge 2>/dev/null || skip "no bridge support in this kernel"
ip -n "$pfx-probe" link add a0 type veth peer name a1 2>/dev/null || skip "no veth support in this kernel"
ip netns del "$pfx-probe"
namespaces=()

scratch="$(mktemp -d "${EMBER_TEST_TMP:-${TMPDIR:-/tmp}}/netns_test.XXXXXX")" || die "mktemp"
say "mode $mode, namespaces $pfx-*, scratch $scratch"
t_start=$SECONDS

# ---- hosts: a bridge in the switch namespace, one veth pair per host ----
sw="$pfx-sw"
hosts=(h0 h1 h2 h3)
declare -A ip_of=([h0]=10.77.0.10 [h1]=10.77.0.11 [h2]=10.77.0.20 [h3]=10.77.0.21)
ps_hosts=(h0 h1)
worker_hosts=(h2 h3)
add_ns "$sw" || die "ip netns add $sw"
ip -n "$sw" link add br0 type bridge || die "bridge in $sw"
ip -n "$sw" link set br0 up || die "br0 up"
for i in "${!hosts[@]}"; do
    h="${hosts[$i]}"
    ns="$pfx-$h"
    add_ns "$ns" || die "ip netns add $ns"
    # Both ends are created inside namespaces: nothing touches the machine's own network.
    ip -n "$sw" link add "p$i" type veth peer name eth0 netns "$ns" || die "veth for $h"
    ip -n "$sw" link set "p$i" master br0 || die "p$i into br0"
    ip -n "$sw" link set "p$i" up || die "p$i up"
    ip -n "$ns" addr add "${ip_of[$h]}/24" dev eth0 || die "address of $h"
    ip -n "$ns" link set eth0 up || die "eth0 up in $h"
done
lo_ns="$pfx-lo" # the loopback reference runs in a namespace of its own
add_ns "$lo_ns" || die "ip netns add $lo_ns"

# ---- data: ~20K generated rows, 18K train in 1024-row blocks (both workers get some) ----
data="$scratch/data"
"$ember" gen --rows 20000 --seed 3 --threads 1 --out "$scratch/data.tsv" >/dev/null 2>"$scratch/gen.log" ||
    die "ember gen: $(tail -n 3 "$scratch/gen.log")"
"$ember" ingest --format criteo --out "$data" --eval-fraction 0.1 --block-rows 1024 --threads 1 \
    "$scratch/data.tsv" >/dev/null 2>"$scratch/ingest.log" ||
    die "ember ingest: $(tail -n 3 "$scratch/ingest.log")"
train_args=(--train "$data/train" --eval "$data/eval" --model mlp --batch 64 --epochs 1 --device cpu
            --threads 1 --staleness 0 --no-progress)

# ---- certificates: a test CA and one EC certificate that every host presents (as server and
# as client; [cluster] names one tls_cert for all). Its names: localhost, which ember's client
# currently expects whatever the PS host, and each host's address both as an IP entry and as a
# DNS entry (mbedTLS 2.x matches a host name given as an IP only against DNS entries). ----
tls="$scratch/certs"
mkdir -p "$tls"
make_certs() {
    local ec=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes) h san="DNS:localhost"
    for h in "${hosts[@]}"; do san="$san,IP:${ip_of[$h]},DNS:${ip_of[$h]}"; done
    printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$san" > "$tls/ext.cnf"
    (
        cd "$tls" &&
            openssl req -x509 "${ec[@]}" -keyout ca.key -out ca.pem -days 2 -subj /CN=ember-netns-test-ca &&
            openssl req "${ec[@]}" -keyout node.key -out node.csr -subj /CN=ember-node &&
            openssl x509 -req -in node.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out node.pem \
                -days 2 -extfile ext.cnf
    ) >"$tls/openssl.log" 2>&1
}
make_certs || die "openssl: $(tail -n 5 "$tls/openssl.log")"

# ---- helpers ----
json_num() { # json_num LINE KEY
    printf '%s\n' "$1" | sed -n "s/.*\"$2\":\\([-0-9.eE+]*\\).*/\\1/p"
}
net_bytes() { # net_bytes NS IFACE -> "rx tx"
    ip netns exec "$1" cat /proc/net/dev | awk -v i="$2:" '$1 == i {print $2, $10}'
}
start() { # start NS ROLE INDEX CLUSTER RUNDIR
    ip netns exec "$1" timeout -k 5 "$job_limit" "$ember" train "${train_args[@]}" --out "$5" \
        --cluster "$4" --role "$2" --index "$3" >"$5/logs/$2-$3.out" 2>"$5/logs/$2-$3.log" &
    pids+=("$!")
    names+=("$2-$3")
    echo "$2 $3 $1 $!" >>"$5/pids"
}
sample_conns() { # every PS host's established connections on the PS port, "psip wip" lines
    local h
    for h in "${ps_hosts[@]}"; do
        ip netns exec "$pfx-$h" ss -Htn state established "( sport = :$port )" 2>/dev/null |
            awk '{split($(NF-1), l, ":"); split($NF, r, ":"); print l[1], r[1]}'
    done
}
timewait_conns() { # TIME-WAIT left on either side once the job is over, same format
    local h
    for h in "${hosts[@]}"; do
        ip netns exec "$pfx-$h" ss -Htn state time-wait 2>/dev/null |
            awk -v p=":$port" '{l = $(NF-1); r = $NF
                 if (l ~ p"$") {split(l, a, ":"); split(r, b, ":"); print a[1], b[1]}
                 else if (r ~ p"$") {split(r, a, ":"); split(l, b, ":"); print a[1], b[1]}}'
    done
}

# ---- the reference: the same job on loopback (tools/launch --transport tcp) ----
ref="$scratch/loopback"
t0=$SECONDS
ip netns exec "$lo_ns" timeout -k 5 $((job_limit + 10)) "$launch" --ember "$ember" --ps 2 --workers 2 \
    --transport tcp --out "$ref" --timeout "$job_limit" -- "${train_args[@]}" >"$scratch/loopback.out" \
    2>"$scratch/loopback.log"
rc=$?
ref_json="$(grep '^{' "$scratch/loopback.out" | tail -n 1)"
{ [ "$rc" = 0 ] && [ -n "$ref_json" ]; } ||
    die "loopback reference job exited $rc: $(tail -n 5 "$scratch/loopback.log")"
ref_auc="$(json_num "$ref_json" auc)"
say "loopback reference ($((SECONDS - t0)) s): $ref_json"
grep -q 'tcp://127\.0\.0\.1:' "$ref/cluster.ini" || die "tools/launch did not write tcp://127.0.0.1 URLs"

# ---- one job across the hosts ----
run_job() { # run_job NAME SCHEME PORT [extra [cluster] lines...]
    # (A port per job: the TIME-WAIT an earlier job leaves must not count as this one's.)
    local name="$1" scheme="$2" port="$3" run="$scratch/$1" h i rc json t0=$SECONDS
    shift 3
    mkdir -p "$run/logs"
    local cluster="$run/cluster.ini" urls=()
    for h in "${ps_hosts[@]}"; do urls+=("$scheme://${ip_of[$h]}:$port"); done
    {
        echo "[cluster]"
        echo "ps = $(IFS=,; echo "${urls[*]}")"
        echo "workers = ${#worker_hosts[@]}"
        printf '%s\n' "$@"
    } >"$cluster"
    say "== $name: $(grep '^ps' "$cluster")"
    declare -A before=()
    for h in "${hosts[@]}"; do before[$h]="$(net_bytes "$pfx-$h" eth0)"; done

    for i in "${!ps_hosts[@]}"; do start "$pfx-${ps_hosts[$i]}" ps "$i" "$cluster" "$run"; done
    # Both PS must listen on their host's address (not loopback) before the workers start.
    local listening=0 t
    for t in $(seq 1 200); do
        listening=0
        for h in "${ps_hosts[@]}"; do
            ip netns exec "$pfx-$h" ss -Htln "( sport = :$port )" | grep -q "${ip_of[$h]}:$port" &&
                listening=$((listening + 1))
        done
        [ "$listening" = "${#ps_hosts[@]}" ] && break
        for i in "${!pids[@]}"; do kill -0 "${pids[$i]}" 2>/dev/null || break 2; done
        sleep 0.1
    done
    [ "$listening" = "${#ps_hosts[@]}" ]
    check $? "$name: both PS listen on their host address"
    for i in "${!worker_hosts[@]}"; do start "$pfx-${worker_hosts[$i]}" worker "$i" "$cluster" "$run"; done

    # Sample the PS hosts' connections while any process runs; every process is bounded by
    # timeout(1), so this loop is too.
    : >"$run/conns"
    local live=1
    while [ "$live" = 1 ]; do
        sample_conns >>"$run/conns"
        live=0
        for i in "${!pids[@]}"; do kill -0 "${pids[$i]}" 2>/dev/null && live=1; done
        [ "$live" = 1 ] && sleep 0.1
    done
    local all_ok=1
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}"
        rc=$?
        if [ "$rc" != 0 ]; then
            all_ok=0
            [ "$rc" = 124 ] && say "$name: ${names[$i]} ran past $job_limit s (timeout)"
            say "$name: ${names[$i]} exited $rc: $(tail -n 3 "$run/logs/${names[$i]}.log" | tr '\n' ' ')"
        fi
    done
    pids=() names=()
    [ "$all_ok" = 1 ]
    check $? "$name: every process (2 PS, 2 workers) exited 0"
    local left=""
    for h in "${hosts[@]}"; do left="$left$(ip netns pids "$pfx-$h")"; done
    [ -z "$left" ]
    check $? "$name: no process left in any host namespace"
    json="$(grep '^{' "$run/logs/worker-0.out" 2>/dev/null | tail -n 1)"
    say "$name ($((SECONDS - t0)) s): ${json:-(no JSON from worker 0)}"
    local auc steps rows eval_rows
    auc="$(json_num "$json" auc)"
    steps="$(json_num "$json" steps)"
    rows="$(json_num "$json" rows)"
    eval_rows="$(json_num "$json" eval_rows)"
    awk -v a="${auc:-0}" "BEGIN {exit !(a > 0.60)}"
    check $? "$name: test AUC ${auc:-none} > 0.60"
    awk -v a="${auc:-0}" -v b="$ref_auc" "BEGIN {d = a - b; if (d < 0) d = -d; exit !(d <= 0.02)}"
    check $? "$name: AUC ${auc:-none} within 0.02 of loopback's $ref_auc"
    [ "${steps:-x}" = "$(json_num "$ref_json" steps)" ] && [ "${rows:-x}" = "$(json_num "$ref_json" rows)" ] &&
        [ "${eval_rows:-x}" = "$(json_num "$ref_json" eval_rows)" ] && [ "${eval_rows:-0}" -gt 1000 ]
    check $? "$name: steps/rows/eval_rows ${steps:-?}/${rows:-?}/${eval_rows:-?} as on loopback"
    local latest
    latest="$(head -n 1 "$run/ckpt/LATEST" 2>/dev/null)"
    [ -n "$latest" ] && [ -f "$run/ckpt/$latest/shard-0/MANIFEST" ] && [ -f "$run/ckpt/$latest/shard-1/MANIFEST" ]
    check $? "$name: final checkpoint ${latest:-(none)} holds both PS shards"
    # Who talked to whom: established connections sampled on the PS hosts, plus the TIME-WAIT
    # either side keeps after the close.
    timewait_conns >>"$run/conns"
    local ph wh
    for ph in "${ps_hosts[@]}"; do
        for wh in "${worker_hosts[@]}"; do
            grep -qx "${ip_of[$ph]} ${ip_of[$wh]}" "$run/conns"
            check $? "$name: PS on $ph (${ip_of[$ph]}:$port) had TCP connections from $wh (${ip_of[$wh]})"
        done
    done
    # A PS that reports its counters when it stops (as `ember ps` does: "shard I stopping:
    # R requests, E errors, B bad messages") must have served requests and no bad ones.
    local stats req err bad
    for i in "${!ps_hosts[@]}"; do
        stats="$(grep -o 'stopping: [0-9]* requests, [0-9]* errors, [0-9]* bad messages' "$run/logs/ps-$i.log")"
        [ -n "$stats" ] || continue
        read -r _ req _ err _ bad _ <<<"$stats"
        [ "$req" -gt 0 ] && [ "$err" = 0 ] && [ "$bad" = 0 ]
        check $? "$name: ps $i served $req requests ($err errors, $bad bad messages)"
    done
    local rx0 tx0 rx1 tx1
    for h in "${ps_hosts[@]}"; do
        read -r rx0 tx0 <<<"${before[$h]}"
        read -r rx1 tx1 <<<"$(net_bytes "$pfx-$h" eth0)"
        [ $((rx1 - rx0)) -ge 4194304 ] && [ $((tx1 - tx0)) -ge 4194304 ]
        check $? "$name: $h's eth0 carried $(((rx1 - rx0) / 1024)) KiB in," \
            "$(((tx1 - tx0) / 1024)) KiB out (>= 4 MiB each)"
    done
}

run_job tcp tcp 7400
run_job tls tls+tcp 7401 "tls_cert = $tls/node.pem" "tls_key = $tls/node.key" "tls_ca = $tls/ca.pem"

say "$failures failure(s) in $((SECONDS - t_start)) s"
[ "$failures" = 0 ] || { say "logs kept in $scratch"; exit 1; }
exit 0
