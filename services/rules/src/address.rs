//! Which IP addresses are public unicast addresses, and why the others are not. Pure: no IO.
//!
//! One classification for every place the relay is told where to connect on a tenant's behalf:
//! the upstream's API (`relay-netguard`) and a tenant's own broker ([`crate::destination`]).
//! Were a non-public address taken, a tenant could make the relay reach what only the relay's
//! own network reaches (a cloud metadata service, Redis on loopback, a database on a private
//! network).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Why an address is not a public unicast address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddressKind {
    /// 0.0.0.0, `::`.
    Unspecified,
    /// 0.0.0.0/8: "this network"; connecting there reaches this machine on some systems.
    ThisNetwork,
    /// 127.0.0.0/8, `::1`.
    Loopback,
    /// 10/8, 172.16/12, 192.168/16 (RFC 1918).
    Private,
    /// 100.64/10 (RFC 6598): a carrier's NAT, often a cloud's internal network.
    SharedAddressSpace,
    /// 169.254/16 (cloud metadata at 169.254.169.254), fe80::/10.
    LinkLocal,
    /// fc00::/7 (RFC 4193; fd00:ec2::254 is a metadata service too).
    UniqueLocal,
    /// fec0::/10, deprecated but still routed inside some networks.
    SiteLocal,
    /// 224/4, ff00::/8.
    Multicast,
    /// 255.255.255.255.
    Broadcast,
    /// 192.0.2/24, 198.51.100/24, 203.0.113/24, 2001:db8::/32, 3fff::/20.
    Documentation,
    /// 198.18/15 (RFC 2544).
    Benchmarking,
    /// 192.0.0/24 (RFC 6890), 240/4, Teredo, and IPv6 outside the global unicast 2000::/3.
    Reserved,
}

impl AddressKind {
    pub fn as_str(self) -> &'static str {
        match self {
            AddressKind::Unspecified => "unspecified",
            AddressKind::ThisNetwork => "this-network",
            AddressKind::Loopback => "loopback",
            AddressKind::Private => "private",
            AddressKind::SharedAddressSpace => "shared (carrier NAT)",
            AddressKind::LinkLocal => "link-local",
            AddressKind::UniqueLocal => "unique-local",
            AddressKind::SiteLocal => "site-local",
            AddressKind::Multicast => "multicast",
            AddressKind::Broadcast => "broadcast",
            AddressKind::Documentation => "documentation",
            AddressKind::Benchmarking => "benchmarking",
            AddressKind::Reserved => "reserved",
        }
    }
}

/// What kind of non-public address `ip` is; `None` for a public unicast address.
///
/// IPv6 forms that carry an IPv4 address (mapped `::ffff:a.b.c.d`, compatible `::a.b.c.d`,
/// NAT64 `64:ff9b::/96`, 6to4 `2002::/16`) are judged by the IPv4 address they carry: a stack
/// that connects to one of them reaches that IPv4 address.
pub fn classify(ip: IpAddr) -> Option<AddressKind> {
    match ip {
        IpAddr::V4(v4) => classify_v4(v4),
        IpAddr::V6(v6) => classify_v6(v6),
    }
}

fn in_v4(ip: u32, net: [u8; 4], prefix: u32) -> bool {
    let net = u32::from_be_bytes(net);
    let mask = if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - prefix)
    };
    ip & mask == net & mask
}

fn classify_v4(ip: Ipv4Addr) -> Option<AddressKind> {
    use AddressKind::*;
    let n = u32::from(ip);
    let ranges: &[([u8; 4], u32, AddressKind)] = &[
        ([0, 0, 0, 0], 32, Unspecified),
        ([0, 0, 0, 0], 8, ThisNetwork),
        ([10, 0, 0, 0], 8, Private),
        ([100, 64, 0, 0], 10, SharedAddressSpace),
        ([127, 0, 0, 0], 8, Loopback),
        ([169, 254, 0, 0], 16, LinkLocal),
        ([172, 16, 0, 0], 12, Private),
        ([192, 0, 0, 0], 24, Reserved),
        ([192, 0, 2, 0], 24, Documentation),
        ([192, 88, 99, 0], 24, Reserved),
        ([192, 168, 0, 0], 16, Private),
        ([198, 18, 0, 0], 15, Benchmarking),
        ([198, 51, 100, 0], 24, Documentation),
        ([203, 0, 113, 0], 24, Documentation),
        ([224, 0, 0, 0], 4, Multicast),
        ([255, 255, 255, 255], 32, Broadcast),
        ([240, 0, 0, 0], 4, Reserved),
    ];
    ranges
        .iter()
        .find(|(net, prefix, _)| in_v4(n, *net, *prefix))
        .map(|(_, _, kind)| *kind)
}

fn in_v6(ip: u128, net: u128, prefix: u32) -> bool {
    let mask = if prefix == 0 {
        0
    } else {
        u128::MAX << (128 - prefix)
    };
    ip & mask == net & mask
}

fn classify_v6(ip: Ipv6Addr) -> Option<AddressKind> {
    use AddressKind::*;
    let n = u128::from(ip);
    let embedded = |shift: u32| Ipv4Addr::from((n >> shift) as u32);
    if n == 0 {
        return Some(Unspecified);
    }
    if n == 1 {
        return Some(Loopback);
    }
    // ::ffff:a.b.c.d (mapped) and ::a.b.c.d (compatible, deprecated): the IPv4 address.
    if in_v6(n, 0xffff << 32, 96) {
        return classify_v4(embedded(0));
    }
    if in_v6(n, 0, 96) {
        return Some(classify_v4(embedded(0)).unwrap_or(Reserved));
    }
    // NAT64's well-known prefix: the gateway connects to the IPv4 address.
    if in_v6(n, 0x0064_ff9b << 96, 96) {
        return classify_v4(embedded(0));
    }
    // NAT64 for local use (RFC 8215).
    if in_v6(n, 0x0064_ff9b_0001 << 80, 48) {
        return Some(Private);
    }
    // 6to4: 2002:AABB:CCDD::/48 carries a.b.c.d.
    if in_v6(n, 0x2002 << 112, 16) {
        return classify_v4(embedded(80));
    }
    let ranges: &[(u128, u32, AddressKind)] = &[
        // Teredo tunnels to an IPv4 address it obfuscates: not worth decoding.
        (0x2001_0000 << 96, 32, Reserved),
        (0x2001_0db8 << 96, 32, Documentation),
        (0x3fff << 112, 20, Documentation),
        (0xfc00 << 112, 7, UniqueLocal),
        (0xfe80 << 112, 10, LinkLocal),
        (0xfec0 << 112, 10, SiteLocal),
        (0xff00 << 112, 8, Multicast),
    ];
    if let Some((_, _, kind)) = ranges
        .iter()
        .find(|(net, prefix, _)| in_v6(n, *net, *prefix))
    {
        return Some(*kind);
    }
    // Everything else outside 2000::/3 is unassigned or special (100::/64 discard-only, ...).
    if !in_v6(n, 0x2000 << 112, 3) {
        return Some(Reserved);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(text: &str) -> Option<AddressKind> {
        classify(text.parse().unwrap())
    }

    #[test]
    fn non_public_ipv4_ranges_are_refused_and_their_neighbours_are_not() {
        use AddressKind::*;
        for (address, expected) in [
            ("0.0.0.0", Unspecified),
            ("0.1.2.3", ThisNetwork),
            ("10.0.0.1", Private),
            ("10.255.255.255", Private),
            ("100.64.0.1", SharedAddressSpace),
            ("100.127.255.254", SharedAddressSpace),
            ("127.0.0.1", Loopback),
            ("127.1.2.3", Loopback),
            ("169.254.169.254", LinkLocal),
            ("172.16.0.1", Private),
            ("172.31.255.255", Private),
            ("192.0.0.8", Reserved),
            ("192.0.2.1", Documentation),
            ("192.168.1.1", Private),
            ("198.18.0.1", Benchmarking),
            ("198.19.255.255", Benchmarking),
            ("198.51.100.7", Documentation),
            ("203.0.113.9", Documentation),
            ("224.0.0.1", Multicast),
            ("239.255.255.250", Multicast),
            ("240.0.0.1", Reserved),
            ("255.255.255.255", Broadcast),
        ] {
            assert_eq!(kind(address), Some(expected), "{address}");
        }
        for public in [
            "1.1.1.1",
            "8.8.8.8",
            "9.255.255.255",
            "11.0.0.0",
            "100.63.255.255",
            "100.128.0.0",
            "126.255.255.255",
            "128.0.0.0",
            "169.253.255.255",
            "172.15.255.255",
            "172.32.0.0",
            "192.167.255.255",
            "192.169.0.0",
            "198.17.255.255",
            "198.20.0.0",
            "223.255.255.255",
        ] {
            assert_eq!(kind(public), None, "{public}");
        }
    }

    #[test]
    fn ipv6_is_judged_by_its_range_or_by_the_ipv4_address_it_carries() {
        use AddressKind::*;
        for (address, expected) in [
            ("::", Unspecified),
            ("::1", Loopback),
            ("::ffff:127.0.0.1", Loopback),
            ("::ffff:169.254.169.254", LinkLocal),
            ("::ffff:10.0.0.1", Private),
            ("::127.0.0.1", Loopback),
            ("::8.8.8.8", Reserved),
            ("64:ff9b::10.0.0.1", Private),
            ("64:ff9b:1::1", Private),
            ("2002:7f00:1::", Loopback),
            ("2002:a9fe:a9fe::1", LinkLocal),
            ("2001::1", Reserved),
            ("2001:db8::1", Documentation),
            ("3fff::1", Documentation),
            ("fd00::1", UniqueLocal),
            ("fd00:ec2::254", UniqueLocal),
            ("fc00::1", UniqueLocal),
            ("fe80::1", LinkLocal),
            ("febf::1", LinkLocal),
            ("fec0::1", SiteLocal),
            ("ff02::1", Multicast),
            ("100::1", Reserved),
            ("4000::1", Reserved),
        ] {
            assert_eq!(kind(address), Some(expected), "{address}");
        }
        for public in [
            "2606:4700:4700::1111",
            "2a00:1450:4001::1",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
            "2002:808:808::1",
        ] {
            assert_eq!(kind(public), None, "{public}");
        }
    }
}
