//! Unit tests of `reach`: which members a rendezvous asks to dial back.

use super::*;

fn member(key: u8, addr: &str) -> PeerAddr {
    PeerAddr {
        key: [key; 32],
        addr: addr.parse().unwrap(),
    }
}

#[test]
fn a_helper_is_at_an_address_neither_the_node_nor_this_node_sent_from() {
    let (node, own) = ([1; 32], [2; 32]);
    let seen: SocketAddr = "203.0.113.7:7001".parse().unwrap();
    let own_ips: Vec<std::net::IpAddr> =
        vec!["10.0.0.5".parse().unwrap(), "198.51.100.2".parse().unwrap()];
    let public = vec![
        member(1, "198.51.100.9:7000"),          // the node itself
        member(2, "198.51.100.9:7000"),          // this node
        member(3, "203.0.113.7:7000"),           // the node's address
        member(4, "10.0.0.5:7002"),              // where packets reach this node
        member(5, "198.51.100.2:7003"),          // the address this node advertises
        member(6, "[2001:db8::6]:7000"),         // another family
        member(7, "[::ffff:198.51.100.2]:7004"), // this node, IPv4-mapped
        member(8, "192.0.2.8:7000"),
        member(9, "[::ffff:192.0.2.9]:7000"),
        member(10, "192.0.2.10:7000"),
    ];
    let chosen: Vec<u8> = helpers(public.clone(), (&node, &own), seen, &own_ips)
        .iter()
        .map(|m| m.key[0])
        .collect();
    assert_eq!(chosen, vec![8, 9], "the first two that qualify, in order");
    // Seen as IPv4-mapped (a node listening on [::]): the same ones.
    let mapped: SocketAddr = "[::ffff:203.0.113.7]:7001".parse().unwrap();
    assert_eq!(helpers(public, (&node, &own), mapped, &own_ips).len(), 2);
    // Everyone on one address (tests on 127.0.0.1): nobody.
    let loopback = vec![member(8, "127.0.0.1:7000"), member(9, "127.0.0.1:7001")];
    let seen: SocketAddr = "127.0.0.1:7002".parse().unwrap();
    assert!(helpers(loopback, (&node, &own), seen, &[]).is_empty());
}
