//! Which addresses the relay refuses to send requests to, and which URLs it takes. Pure: no IO.
//!
//! A tenant names the upstream's base URL, and the relay then sends requests there with the
//! tenant's API key. Were any address allowed, a tenant could make the relay reach what only the
//! relay's own network reaches (a cloud metadata service, Redis on loopback, a database on a
//! private network) and learn from the answers, or the timings, what is there. So only public
//! unicast addresses are taken, unless the operator says otherwise.

use ipnet::IpNet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use url::{Host, Url};

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

/// What the operator allows beyond https to public addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutboundPolicy {
    /// Plain http:// URLs.
    pub allow_http: bool,
    /// Loopback, private, link-local and every other non-public address (see [`classify`]).
    pub allow_private: bool,
    /// Non-public networks allowed one by one, when `allow_private` is off: an upstream (or a
    /// proxy in front of it) on a private network of the operator's, and nothing else there.
    pub allowed_networks: Vec<IpNet>,
}

/// Why a URL or an address is refused. The text says why without repeating the URL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("not an absolute URL")]
    NotAUrl,
    #[error("an https:// URL with a host (the operator allows no other scheme)")]
    HttpsOnly,
    #[error("an http:// or https:// URL with a host")]
    HttpOrHttps,
    #[error(
        "{address} is a {} address: the relay sends requests only to public addresses",
        .kind.as_str()
    )]
    Address { address: IpAddr, kind: AddressKind },
    #[error("`{0}` names this machine: the relay sends requests only to public addresses")]
    LocalName(String),
    #[error("`{0}` resolves to no public address")]
    NoPublicAddress(String),
}

impl OutboundPolicy {
    /// Everything allowed: for tests and demos on one machine.
    pub const ANY: OutboundPolicy = OutboundPolicy {
        allow_http: true,
        allow_private: true,
        allowed_networks: Vec::new(),
    };

    /// Refuses `address` unless it is public, the operator allows non-public ones, or it lies
    /// in a network the operator allows.
    pub fn check_address(&self, address: IpAddr) -> Result<(), Refusal> {
        match classify(address) {
            Some(kind)
                if !self.allow_private
                    && !self.allowed_networks.iter().any(|n| n.contains(&address)) =>
            {
                Err(Refusal::Address { address, kind })
            }
            _ => Ok(()),
        }
    }

    /// Refuses a host name that means this machine whatever DNS says (RFC 6761's `localhost`).
    pub fn check_name(&self, name: &str) -> Result<(), Refusal> {
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        if !self.allow_private && (name == "localhost" || name.ends_with(".localhost")) {
            return Err(Refusal::LocalName(name));
        }
        Ok(())
    }

    /// Parses `text` as a URL the relay may send requests to: its scheme, and its host when the
    /// host is a literal address (in any spelling the URL standard takes: `0x7f000001`,
    /// `2130706433` and `0177.0.0.1` are all 127.0.0.1) or a name for this machine. A name's
    /// addresses are checked when connecting, after resolution ([`crate::GuardedResolver`]).
    pub fn check_url(&self, text: &str) -> Result<Url, Refusal> {
        let url = Url::parse(text.trim()).map_err(|_| Refusal::NotAUrl)?;
        let scheme_ok = match url.scheme() {
            "https" => true,
            "http" => self.allow_http,
            _ => false,
        };
        let scheme_refusal = if self.allow_http {
            Refusal::HttpOrHttps
        } else {
            Refusal::HttpsOnly
        };
        if !scheme_ok {
            return Err(scheme_refusal);
        }
        match url.host() {
            None => return Err(scheme_refusal),
            Some(Host::Ipv4(v4)) => self.check_address(IpAddr::V4(v4))?,
            Some(Host::Ipv6(v6)) => self.check_address(IpAddr::V6(v6))?,
            Some(Host::Domain(name)) => self.check_name(name)?,
        }
        Ok(url)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_allowed_network_lets_its_addresses_through_and_no_other() {
        let policy = OutboundPolicy {
            allow_http: true,
            allow_private: false,
            allowed_networks: vec![
                "127.0.0.2/32".parse().unwrap(),
                "10.1.2.0/24".parse().unwrap(),
            ],
        };
        for allowed in [
            "http://127.0.0.2:9700/",
            "http://10.1.2.3/",
            "https://10.1.2.255/v1",
        ] {
            assert!(policy.check_url(allowed).is_ok(), "{allowed}");
        }
        for refused in [
            "http://127.0.0.1:9700/",
            "http://0x7f000001/",
            "http://10.1.3.1/",
            "http://169.254.169.254/",
            "http://[fd00::1]/",
            "http://localhost:9700/",
        ] {
            assert!(policy.check_url(refused).is_err(), "{refused}");
        }
    }

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

    fn refused(policy: &OutboundPolicy, url: &str) -> Refusal {
        policy.check_url(url).expect_err(url)
    }

    #[test]
    fn the_default_takes_https_to_public_hosts_only() {
        let policy = OutboundPolicy::default();
        assert_eq!(
            policy.check_url("https://api.quanor.com").unwrap().as_str(),
            "https://api.quanor.com/"
        );
        policy.check_url("https://8.8.8.8:8443/x").unwrap();
        policy.check_url("https://[2606:4700:4700::1111]/").unwrap();
        for url in [
            "http://api.quanor.com",
            "ftp://api.quanor.com",
            "file:///etc/passwd",
            "gopher://x",
        ] {
            assert_eq!(refused(&policy, url), Refusal::HttpsOnly, "{url}");
        }
        assert_eq!(refused(&policy, "api.quanor.com"), Refusal::NotAUrl);
        for (url, address) in [
            (
                "https://169.254.169.254/latest/meta-data",
                "169.254.169.254",
            ),
            ("https://10.0.0.1", "10.0.0.1"),
            ("https://[fd00::1]", "fd00::1"),
            ("https://[::ffff:127.0.0.1]", "::ffff:127.0.0.1"),
            ("https://0x7f000001", "127.0.0.1"),
            ("https://2130706433", "127.0.0.1"),
            ("https://0177.0.0.1", "127.0.0.1"),
            ("https://127.1", "127.0.0.1"),
            ("https://0", "0.0.0.0"),
            ("https://0xa9.0xfe.0xa9.0xfe", "169.254.169.254"),
        ] {
            match refused(&policy, url) {
                Refusal::Address { address: found, .. } => {
                    assert_eq!(found, address.parse::<IpAddr>().unwrap(), "{url}")
                }
                other => panic!("{url}: {other:?}"),
            }
        }
        for url in [
            "https://localhost",
            "https://LOCALHOST.:6379",
            "https://redis.localhost",
        ] {
            assert!(
                matches!(refused(&policy, url), Refusal::LocalName(_)),
                "{url}"
            );
        }
    }

    #[test]
    fn the_operator_may_allow_http_and_private_addresses_apart() {
        let http = OutboundPolicy {
            allow_http: true,
            allow_private: false,
            allowed_networks: Vec::new(),
        };
        http.check_url("http://api.quanor.com").unwrap();
        assert!(matches!(
            refused(&http, "http://localhost:6379"),
            Refusal::LocalName(_)
        ));
        assert!(matches!(
            refused(&http, "http://127.0.0.1:9700"),
            Refusal::Address { .. }
        ));
        assert_eq!(refused(&http, "ftp://x"), Refusal::HttpOrHttps);
        let private = OutboundPolicy {
            allow_http: false,
            allow_private: true,
            allowed_networks: Vec::new(),
        };
        private.check_url("https://127.0.0.1:9700").unwrap();
        assert_eq!(
            refused(&private, "http://127.0.0.1:9700"),
            Refusal::HttpsOnly
        );
        OutboundPolicy::ANY
            .check_url("http://localhost:9700")
            .unwrap();
    }

    #[test]
    fn a_refusal_says_why_without_the_url() {
        let text = refused(
            &OutboundPolicy::default(),
            "https://169.254.169.254/secret-path",
        )
        .to_string();
        assert!(text.contains("link-local"), "{text}");
        assert!(!text.contains("secret-path"), "{text}");
    }
}
