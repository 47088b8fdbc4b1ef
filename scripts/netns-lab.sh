#!/usr/bin/env bash
# A test network in network namespaces (root only): a public segment and two
# homes behind NAT, so nodes can join and serve across NATs on one machine.
#
#   scripts/netns-lab.sh up [PREFIX]     build it (PREFIX names the namespaces, default "lab")
#   scripts/netns-lab.sh down [PREFIX]   remove it
#   scripts/netns-lab.sh check           exit 0 when this machine can build it, else say why
#
#   PREFIX-wan   the public segment: a bridge, 10.77.0.1/24 ("the internet")
#   PREFIX-pub   a public host, 10.77.0.10 (a coordinator, a relay)
#   PREFIX-pub2  a second public host, 10.77.0.11
#   PREFIX-r1    home 1's router: 10.77.0.21 outside, 192.168.1.1 inside;
#                MASQUERADE (endpoint-independent mapping: one public port for
#                every destination, replies only)
#   PREFIX-h1    a machine in home 1, 192.168.1.2
#   PREFIX-r2    home 2's router: 10.77.0.22 outside, 192.168.2.1 inside;
#                MASQUERADE --random-fully (a new public port for every
#                destination: a symmetric NAT; HOME2_NAT=cone makes it
#                home 1's kind, HOME2_NAT=address home 1's kind that lets
#                in a new flow from any port of an address the home sent
#                to: a NAT that filters by address only)
#   PREFIX-h2    a machine in home 2, 192.168.2.2
#
# HOME_DELAY_MS (default 20; 0 for none) is each home's outside link's round
# trip, half each way. The link is a pair of TAP devices joined by
# scripts/netns-delay.py, in user space: tc netem is not in every kernel
# (not in this project's CI machine's), and one way is tested everywhere.
set -euo pipefail

prefix="${2:-lab}"
delay="${HOME_DELAY_MS:-20}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
pump_pid="/run/netns-lab-$prefix.pid"
pump_log="/run/netns-lab-$prefix.log"

check() {
  if [[ "$(id -u)" != 0 ]]; then echo "the lab needs root (network namespaces, iptables)"; return 1; fi
  for tool in ip iptables; do
    command -v "$tool" >/dev/null || { echo "the lab needs $tool (Debian: iproute2, iptables)"; return 1; }
  done
  local probe="${prefix}-probe$$"
  if ! ip netns add "$probe" 2>/dev/null; then echo "cannot make a network namespace here"; return 1; fi
  if ! ip netns exec "$probe" iptables -t nat -A POSTROUTING -j MASQUERADE 2>/dev/null; then
    ip netns del "$probe"
    echo "this kernel has no NAT table for iptables"
    return 1
  fi
  ip netns del "$probe"
  if [[ "$delay" != 0 ]]; then
    command -v python3 >/dev/null || { echo "the lab's delayed links need python3 (or HOME_DELAY_MS=0)"; return 1; }
    [[ -c /dev/net/tun ]] || { echo "the lab's delayed links need /dev/net/tun (or HOME_DELAY_MS=0)"; return 1; }
  fi
}

in_ns() { ip netns exec "$prefix-$1" "${@:2}"; }

# A veth pair from namespace $1 (interface $2, address $3) to the public bridge.
to_wan() {
  local ns="$prefix-$1" name="$2" address="$3"
  local outer="${prefix}w-$1"
  ip link add "$outer" type veth peer name "$name" netns "$ns"
  ip link set "$outer" netns "$prefix-wan"
  in_ns wan ip link set "$outer" master br0 up
  in_ns "$1" ip addr add "$address/24" dev "$name"
  in_ns "$1" ip link set "$name" up
}

# As to_wan, over a delayed link: a TAP device on each side, which
# netns-delay.py joins once every home is built.
delayed_to_wan() {
  local ns="$prefix-$1" name="$2" address="$3"
  local outer="${prefix}w-$1"
  in_ns wan ip tuntap add dev "$outer" mode tap
  in_ns "$1" ip tuntap add dev "$name" mode tap
  in_ns wan ip link set "$outer" master br0 up
  in_ns "$1" ip addr add "$address/24" dev "$name"
  in_ns "$1" ip link set "$name" up
}

home() {
  local n="$1" mode="$2" filter="${3:-port}"
  ip netns add "$prefix-r$n"
  ip netns add "$prefix-h$n"
  for ns in "r$n" "h$n"; do in_ns "$ns" ip link set lo up; done
  if [[ "$delay" != 0 ]]; then
    delayed_to_wan "r$n" wan0 "10.77.0.2$n"
  else
    to_wan "r$n" wan0 "10.77.0.2$n"
  fi
  ip link add "${prefix}l-$n" netns "$prefix-r$n" type veth peer name lan0 netns "$prefix-h$n"
  in_ns "r$n" ip addr add "192.168.$n.1/24" dev "${prefix}l-$n"
  in_ns "r$n" ip link set "${prefix}l-$n" up
  in_ns "h$n" ip addr add "192.168.$n.2/24" dev lan0
  in_ns "h$n" ip link set lan0 up
  in_ns "h$n" ip route add default via "192.168.$n.1"
  in_ns "r$n" sysctl -q -w net.ipv4.ip_forward=1
  # shellcheck disable=SC2086
  in_ns "r$n" iptables -t nat -A POSTROUTING -o wan0 -j MASQUERADE $mode
  if [[ "$filter" == address ]]; then
    # Filtering by address only: every address the home sent UDP to is
    # remembered, and a new flow from any port of it reaches the home
    # machine at the port it came to (the NAT keeps the home's ports).
    in_ns "r$n" iptables -t mangle -A FORWARD -i "${prefix}l-$n" -o wan0 -p udp \
      -m recent --name sent --rdest --set
    in_ns "r$n" iptables -t nat -A PREROUTING -i wan0 -p udp \
      -m recent --name sent --rcheck --rsource -j DNAT --to-destination "192.168.$n.2"
    in_ns "r$n" iptables -A FORWARD -i wan0 -p udp -m conntrack --ctstate DNAT -j ACCEPT
  fi
  # Nothing else from outside reaches the home unless it answers what left it.
  in_ns "r$n" iptables -A FORWARD -i wan0 -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
  in_ns "r$n" iptables -A FORWARD -i wan0 -j DROP
  # Nor the router itself, as home routers do (a packet let in here would
  # leave a conntrack entry that changes the port the NAT maps to next).
  in_ns "r$n" iptables -A INPUT -i wan0 -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
  in_ns "r$n" iptables -A INPUT -i wan0 -j DROP
}

# The delayed links' pump, detached (it outlives `up`), until `down`.
start_pump() {
  setsid python3 "$here/netns-delay.py" "$delay" \
    "$prefix-wan" "${prefix}w-r1" "$prefix-r1" wan0 \
    "$prefix-wan" "${prefix}w-r2" "$prefix-r2" wan0 \
    >"$pump_log" 2>&1 </dev/null &
  echo $! >"$pump_pid"
  local i
  for i in $(seq 50); do
    grep -q ready "$pump_log" 2>/dev/null && return 0
    kill -0 "$(cat "$pump_pid")" 2>/dev/null || break
    sleep 0.1
  done
  echo "netns-delay.py did not start: $(cat "$pump_log")" >&2
  return 1
}

up() {
  check
  down 2>/dev/null || true
  ip netns add "$prefix-wan"
  in_ns wan ip link set lo up
  in_ns wan ip link add br0 type bridge
  in_ns wan ip addr add 10.77.0.1/24 dev br0
  in_ns wan ip link set br0 up
  ip netns add "$prefix-pub"
  in_ns pub ip link set lo up
  to_wan pub eth0 10.77.0.10
  ip netns add "$prefix-pub2"
  in_ns pub2 ip link set lo up
  to_wan pub2 eth0 10.77.0.11
  home 1 ""
  case "${HOME2_NAT:-symmetric}" in
    cone) home 2 "" ;;
    address) home 2 "" address ;;
    *) home 2 "--random-fully" ;;
  esac
  if [[ "$delay" != 0 ]]; then start_pump; fi
}

down() {
  local ns
  if [[ -f "$pump_pid" ]]; then
    kill "$(cat "$pump_pid")" 2>/dev/null || true
    rm -f "$pump_pid" "$pump_log"
  fi
  for ns in h2 r2 h1 r1 pub2 pub wan; do
    ip netns del "$prefix-$ns" 2>/dev/null || true
  done
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  check) check ;;
  *) sed -n '2,26p' "$0"; exit 2 ;;
esac
