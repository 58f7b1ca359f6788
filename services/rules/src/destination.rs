//! Where a tenant's own-exchange destination may point: decided from the URL's host and the
//! addresses it resolved to, so the control plane (at registration) and the publisher (at every
//! connect, since a DNS answer can change) decide the same way. The resolving is the caller's.
//!
//! The danger is the relay's own broker: its credentials open every tenant's queue, and a
//! destination there with exchange `""` and routing key `relay.tenant.<B>` would put one
//! tenant's changes into another's queue. So an address of the relay's broker is refused
//! whatever the operator allows, and so are loopback, private, link-local and other
//! non-public addresses (where the relay's broker, its cluster's other nodes and everything
//! else of the relay's own usually live) unless the operator allows them.

use std::net::{IpAddr, SocketAddr};

/// What the operator lets tenants name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DestinationPolicy {
    /// Host patterns a destination's host must match: `broker.example.com` (that host), or
    /// `*.example.com` (any name below it). Empty: any host.
    pub allowed_hosts: Vec<String>,
    /// Let destinations resolve to loopback, private, link-local and other non-public
    /// addresses (a relay whose tenants' brokers are on its own network; tests).
    pub allow_private: bool,
}

/// Why a destination is refused (its `Display` is the detail a tenant is shown).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("host {0} is not among the hosts the operator allows")]
    HostNotAllowed(String),
    #[error("{0} is the relay's own broker")]
    RelayBroker(SocketAddr),
    #[error("{0} is not a public address (loopback, private, link-local or reserved)")]
    NotPublic(IpAddr),
    #[error("the host resolves to no address")]
    Unresolved,
}

impl DestinationPolicy {
    /// Whether `host` (as the URL names it, lower case) may be named at all.
    pub fn check_host(&self, host: &str) -> Result<(), Refusal> {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        let allowed = self.allowed_hosts.is_empty()
            || self.allowed_hosts.iter().any(|pattern| {
                let pattern = pattern.trim().trim_end_matches('.').to_ascii_lowercase();
                match pattern.strip_prefix("*.") {
                    Some(domain) => host
                        .strip_suffix(domain)
                        .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
                    None => host == pattern.trim_start_matches('[').trim_end_matches(']'),
                }
            });
        if allowed {
            Ok(())
        } else {
            Err(Refusal::HostNotAllowed(host))
        }
    }

    /// Decides a destination: `host` as the URL names it, `resolved` every address it resolved
    /// to (with the URL's port), `relay_broker` every address the relay's own broker resolves
    /// to. Refused when any address is refused: a connect may take any of them.
    pub fn check(
        &self,
        host: &str,
        resolved: &[SocketAddr],
        relay_broker: &[SocketAddr],
    ) -> Result<(), Refusal> {
        self.check_host(host)?;
        if resolved.is_empty() {
            return Err(Refusal::Unresolved);
        }
        for address in resolved {
            if relay_broker
                .iter()
                .any(|relay| same_listener(*address, *relay))
            {
                return Err(Refusal::RelayBroker(*address));
            }
            let ip = canonical(address.ip());
            if !self.allow_private && !is_public(ip) {
                return Err(Refusal::NotPublic(ip));
            }
        }
        Ok(())
    }
}

/// Whether a connect to `a` may reach the listener at `b`: the same port, and the same
/// address, or both on this machine (any loopback address, or the unspecified address, reach
/// a listener bound to loopback or to every interface).
pub fn same_listener(a: SocketAddr, b: SocketAddr) -> bool {
    if a.port() != b.port() {
        return false;
    }
    let (a, b) = (canonical(a.ip()), canonical(b.ip()));
    a == b || (is_this_machine(a) && is_this_machine(b))
}

fn is_this_machine(ip: IpAddr) -> bool {
    ip.is_loopback() || ip.is_unspecified()
}

/// An IPv4 address written as IPv6 (`::ffff:a.b.c.d`) is that IPv4 address.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

/// Whether `ip` is a public unicast address (see [`crate::address::classify`]).
pub fn is_public(ip: IpAddr) -> bool {
    crate::address::classify(ip).is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(text: &str) -> SocketAddr {
        text.parse().unwrap()
    }

    #[test]
    fn the_relays_broker_is_refused_whatever_the_operator_allows() {
        let open = DestinationPolicy {
            allowed_hosts: vec![],
            allow_private: true,
        };
        let relay = [addr("127.0.0.1:5672"), addr("[::1]:5672")];
        for address in [
            "127.0.0.1:5672",
            "127.0.0.2:5672",
            "0.0.0.0:5672",
            "[::1]:5672",
            "[::ffff:127.0.0.1]:5672",
            "[::]:5672",
        ] {
            assert_eq!(
                open.check("h", &[addr(address)], &relay),
                Err(Refusal::RelayBroker(addr(address))),
                "{address}"
            );
        }
        // Another port on this machine is another listener.
        assert_eq!(open.check("h", &[addr("127.0.0.1:5673")], &relay), Ok(()));
        // One refused address among several refuses the destination.
        let mixed = [addr("127.0.0.1:5673"), addr("127.0.0.1:5672")];
        assert!(open.check("h", &mixed, &relay).is_err());
        // A relay broker on a private address: that address, and no other.
        let relay = [addr("10.1.2.3:5672")];
        assert!(open.check("h", &[addr("10.1.2.3:5672")], &relay).is_err());
        assert_eq!(open.check("h", &[addr("10.1.2.4:5672")], &relay), Ok(()));
    }

    #[test]
    fn non_public_addresses_are_refused_by_default() {
        let policy = DestinationPolicy::default();
        for ip in [
            "127.0.0.1",
            "10.0.0.1",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "224.0.0.1",
            "255.255.255.255",
            "::1",
            "::",
            "fd00::1",
            "fe80::1",
            "::ffff:10.0.0.1",
            "64:ff9b::a00:1",
            "2001:db8::1",
            "2002:a00:1::1",
            "ff02::1",
        ] {
            let address = SocketAddr::new(ip.parse().unwrap(), 5672);
            assert!(
                matches!(
                    policy.check("h", &[address], &[]),
                    Err(Refusal::NotPublic(_))
                ),
                "{ip}"
            );
        }
        for ip in ["8.8.8.8", "1.1.1.1", "2606:4700::1111", "64:ff9b::808:808"] {
            let address = SocketAddr::new(ip.parse().unwrap(), 5672);
            assert_eq!(policy.check("h", &[address], &[]), Ok(()), "{ip}");
        }
        assert_eq!(policy.check("h", &[], &[]), Err(Refusal::Unresolved));
    }

    #[test]
    fn host_patterns_name_a_host_or_the_names_below_a_domain() {
        let policy = DestinationPolicy {
            allowed_hosts: vec!["broker.example.com".into(), "*.tenants.example.net".into()],
            allow_private: false,
        };
        assert_eq!(policy.check_host("broker.example.com"), Ok(()));
        assert_eq!(policy.check_host("BROKER.example.com."), Ok(()));
        assert_eq!(policy.check_host("a.tenants.example.net"), Ok(()));
        assert_eq!(policy.check_host("a.b.tenants.example.net"), Ok(()));
        for refused in [
            "tenants.example.net",
            "evil-tenants.example.net",
            "example.com",
            "broker.example.com.evil",
            "127.0.0.1",
        ] {
            assert!(policy.check_host(refused).is_err(), "{refused}");
        }
        assert_eq!(DestinationPolicy::default().check_host("anything"), Ok(()));
    }
}
