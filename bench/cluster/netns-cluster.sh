#!/usr/bin/env bash
# An emulated cluster on one machine: N hosts as network namespaces, each with one veth joined
# to a bridge that has no address (so nothing the hosts send can leave them), every link shaped
# in both directions with tc tbf. Runs one command with the cluster up, then removes everything
# it created: on success, on failure, and on Ctrl-C or SIGTERM.
#
#   sudo bench/cluster/netns-cluster.sh --hosts 4 --rate 1gbit -- \
#       sh -c '"$CLUSTER_MPIRUN" -np 4 build-cluster/bench/cluster/probe/cluster-probe'
#
# Inside the command, $CLUSTER_MPIRUN is a launcher that runs Open MPI's mpirun with one rank
# per host and the recipe measured on this machine (issue 6); arguments after it go to mpirun.
# $CLUSTER_HOSTS (space-separated host names), $CLUSTER_SUBNET, $CLUSTER_RATE, $CLUSTER_IFNAME
# (the hosts' interface, the same name in every namespace) and $CLUSTER_MASTER (the first host's
# address, for rendezvous) are set too.
#
# Why the pieces are as they are:
# - mpirun itself runs inside the first host's namespace: the bridge has no address, so the
#   root namespace cannot reach the hosts, and the orteds must reach mpirun over TCP.
# - Host names are the namespace names; `ip netns exec` bind-mounts /etc/netns/NAME/hosts over
#   /etc/hosts, which is how the names resolve inside the hosts without touching /etc/hosts.
# - mpi_yield_when_idle: every namespace looks like a node of its own, so Open MPI does not see
#   that the ranks share the cores and would spin; spinning ranks starve the kernel's network
#   processing (softirq) and the other ranks, which showed as 12 ms stalls in a 256 KiB all-reduce.
# - rtc ^hwloc: an orted sometimes crashed in hwloc_shmem_topology_write (sharing the topology in
#   shared memory at a fixed address); nothing is bound here, so the component is not needed.
# - tbf only (this kernel has no netem): rate, no added delay. A packet crosses its sender's
#   shaper and its receiver's, as with a switch of full bisection.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

usage() {
  cat <<EOF
usage: $(basename "$0") [--hosts N] [--rate RATE] [--subnet A.B.C] [--mtu BYTES] [--tag T] -- COMMAND...
  --hosts N       hosts (network namespaces), one MPI rank each (default 2, at most 250)
  --rate RATE     tc rate of every link, each direction: e.g. 1gbit, 10gbit, 500mbit (default 1gbit)
  --subnet A.B.C  the hosts get A.B.C.1 .. A.B.C.N/24 inside their namespaces (default 10.213.0)
  --burst BYTES   tbf bucket size (default: see below)
  --mtu BYTES     MTU of the veth links (default 1500, as on ordinary Ethernet)
  --tag T         short tag in the names of what is created (default: this shell's PID)
EOF
}

hosts=2 rate=1gbit subnet=10.213.0 mtu=1500 tag=$$ burst=
while [[ $# -gt 0 ]]; do
  case $1 in
  --hosts) hosts=$2; shift 2 ;;
  --rate) rate=$2; shift 2 ;;
  --burst) burst=$2; shift 2 ;;
  --subnet) subnet=$2; shift 2 ;;
  --mtu) mtu=$2; shift 2 ;;
  --tag) tag=$2; shift 2 ;;
  -h | --help) usage; exit 0 ;;
  --) shift; break ;;
  *) echo "netns-cluster.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
if [[ $# -eq 0 ]]; then
  echo "netns-cluster.sh: no command to run on the cluster (give it after --)" >&2
  usage >&2
  exit 2
fi
if [[ $(id -u) -ne 0 ]]; then
  echo "netns-cluster.sh: must run as root: it creates network namespaces, veth pairs, a bridge and" \
    "tc qdiscs (try: sudo $0 ...)" >&2
  exit 1
fi
[[ $hosts =~ ^[0-9]+$ && $hosts -ge 1 && $hosts -le 250 ]] ||
  { echo "netns-cluster.sh: --hosts must be 1..250, got '$hosts'" >&2; exit 2; }
[[ $subnet =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] ||
  { echo "netns-cluster.sh: --subnet must be three octets like 10.213.0, got '$subnet'" >&2; exit 2; }
[[ $tag =~ ^[0-9a-z]{1,6}$ ]] ||
  { echo "netns-cluster.sh: --tag must be 1-6 lower-case letters or digits, got '$tag'" >&2; exit 2; }

# tbf's bucket is what passes at memory speed before the rate applies: 1 ms at the link rate,
# never below 64 KiB (one GSO packet). Smaller buckets make tbf's timer the bottleneck on this
# 2-core machine: with 25 KB, four TCP flows in a ring reached 0.22 of 1 Gbit/s each; with
# 125 KB, 0.89-0.94.
rate_bits() {
  local r=${1,,} n unit
  [[ $r =~ ^([0-9]+)(bit|kbit|mbit|gbit)$ ]] ||
    { echo "netns-cluster.sh: --rate must look like 1gbit, 10gbit or 500mbit, got '$1'" >&2; exit 2; }
  n=${BASH_REMATCH[1]} unit=${BASH_REMATCH[2]}
  case $unit in
  bit) echo "$n" ;;
  kbit) echo $((n * 1000)) ;;
  mbit) echo $((n * 1000000)) ;;
  gbit) echo $((n * 1000000000)) ;;
  esac
}
bits=$(rate_bits "$rate")
if [[ -z $burst ]]; then
  burst=$((bits / 8 / 1000))
  ((burst < 65536)) && burst=65536
fi
[[ $burst =~ ^[0-9]+$ ]] || { echo "netns-cluster.sh: --burst must be a number of bytes, got '$burst'" >&2; exit 2; }

prefix="cc${tag}"            # interface names: at most 15 characters
bridge="${prefix}br"
ifname=cluster0 # the hosts' interface, inside their namespaces
names=()
for ((i = 0; i < hosts; ++i)); do names+=("concerto-${tag}-h${i}"); done
etc_netns_was_there=0
[[ -d /etc/netns ]] && etc_netns_was_there=1
workdir=$(mktemp -d "/tmp/concerto-cluster-${tag}.XXXXXX")
child=

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  set +e
  if [[ -n $child ]] && kill -0 "$child" 2>/dev/null; then kill -TERM "$child" 2>/dev/null; fi
  # Processes still inside our namespaces (orteds, ranks) were started by this script's command.
  for ns in "${names[@]}"; do
    [[ -e /run/netns/$ns ]] || continue
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -TERM "$pid" 2>/dev/null; done
  done
  sleep 0.2
  for ns in "${names[@]}"; do
    [[ -e /run/netns/$ns ]] || continue
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null # takes the veth pair with it
    rm -rf "/etc/netns/$ns" "/tmp/concerto-orte-$ns" # the second: netns-rsh's session directory
  done
  for ((i = 0; i < hosts; ++i)); do ip link del "${prefix}v${i}" 2>/dev/null; done
  ip link del "$bridge" 2>/dev/null
  ((etc_netns_was_there)) || rmdir /etc/netns 2>/dev/null
  rm -rf "$workdir"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

for ns in "${names[@]}"; do
  if [[ -e /run/netns/$ns ]]; then
    echo "netns-cluster.sh: namespace '$ns' already exists; another cluster with tag '$tag' is up" >&2
    names=() # not ours: leave it alone
    exit 1
  fi
done

ip link add "$bridge" type bridge
ip link set "$bridge" up
hosts_file="$workdir/etc-hosts"
{
  echo "127.0.0.1 localhost"
  for ((i = 0; i < hosts; ++i)); do echo "${subnet}.$((i + 1)) ${names[$i]}"; done
} >"$hosts_file"
for ((i = 0; i < hosts; ++i)); do
  ns=${names[$i]} outer="${prefix}v${i}" inner="${prefix}p${i}"
  ip netns add "$ns"
  mkdir -p "/etc/netns/$ns"
  cp "$hosts_file" "/etc/netns/$ns/hosts"
  : >"/etc/netns/$ns/resolv.conf" # no DNS inside: names come from the hosts file only
  ip link add "$outer" mtu "$mtu" type veth peer name "$inner" mtu "$mtu"
  ip link set "$inner" netns "$ns"
  ip link set "$outer" master "$bridge"
  ip link set "$outer" up
  # One interface name on every host, so that a program can be told it once (GLOO_SOCKET_IFNAME).
  ip -n "$ns" link set "$inner" name "$ifname"
  inner=$ifname
  ip -n "$ns" link set lo up
  ip -n "$ns" addr add "${subnet}.$((i + 1))/24" dev "$inner"
  ip -n "$ns" link set "$inner" up
  # Both directions: the bridge side shapes what the host receives, the namespace side what it sends.
  tc qdisc add dev "$outer" root tbf rate "$rate" burst "$burst" latency 20ms
  ip netns exec "$ns" tc qdisc add dev "$inner" root tbf rate "$rate" burst "$burst" latency 20ms
done

{
  echo "# one slot per host: one rank per namespace"
  for ns in "${names[@]}"; do echo "$ns slots=1"; done
} >"$workdir/hostfile"

# The launcher. Options after it on the command line go to mpirun, so a caller can add -x or --mca.
cat >"$workdir/mpirun" <<EOF
#!/bin/sh
exec ip netns exec ${names[0]} mpirun --allow-run-as-root \\
  --hostfile $workdir/hostfile --map-by node --bind-to none \\
  --mca plm_rsh_agent $here/netns-rsh \\
  --mca pml ob1 --mca btl tcp,self \\
  --mca btl_tcp_if_include ${subnet}.0/24 --mca oob_tcp_if_include ${subnet}.0/24 \\
  --mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm 4 \\
  --mca coll_libnbc_iallreduce_algorithm 1 \\
  --mca mpi_yield_when_idle 1 --mca rtc ^hwloc \\
  -x GLIBC_TUNABLES=glibc.malloc.hugetlb=1 \\
  -x OMP_NUM_THREADS=\${OMP_NUM_THREADS:-1} -x OPENBLAS_NUM_THREADS=\${OPENBLAS_NUM_THREADS:-1} \\
  "\$@"
EOF
chmod +x "$workdir/mpirun"

export CLUSTER_MPIRUN="$workdir/mpirun" CLUSTER_HOSTS="${names[*]}" CLUSTER_SUBNET="${subnet}.0/24"
export CLUSTER_RATE="$rate" CLUSTER_HOSTFILE="$workdir/hostfile" CLUSTER_IFNAME="$ifname"
export CLUSTER_MASTER="${subnet}.1" # the first host's address
echo "netns-cluster.sh: $hosts hosts at $rate (tbf burst $burst B, MTU $mtu) on ${subnet}.0/24: ${names[*]}" >&2

# In the background so that a signal to this script runs the cleanup at once, not after the child.
"$@" &
child=$!
wait "$child"
