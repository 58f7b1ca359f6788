//! Which addresses the relay refuses to send requests to, and which URLs it takes. Pure: no IO.
//!
//! A tenant names the upstream's base URL, and the relay then sends requests there with the
//! tenant's API key. Were any address allowed, a tenant could make the relay reach what only the
//! relay's own network reaches (a cloud metadata service, Redis on loopback, a database on a
//! private network) and learn from the answers, or the timings, what is there. So only public
//! unicast addresses are taken, unless the operator says otherwise.

use ipnet::IpNet;
use relay_rules::{classify, AddressKind};
use std::net::IpAddr;

use url::{Host, Url};

/// What the operator allows beyond https to public addresses, and how much of an answer the
/// relay reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboundPolicy {
    /// Plain http:// URLs.
    pub allow_http: bool,
    /// Loopback, private, link-local and every other non-public address (see [`classify`]).
    pub allow_private: bool,
    /// Non-public networks allowed one by one, when `allow_private` is off: an upstream (or a
    /// proxy in front of it) on a private network of the operator's, and nothing else there.
    pub allowed_networks: Vec<IpNet>,
    /// The most bytes of one answer's body the relay reads (see
    /// [`DEFAULT_MAX_ANSWER_BYTES`]): past it the read fails, so what a tenant's upstream
    /// answers never costs more memory than this.
    pub max_answer_bytes: u64,
}

/// The default bound on one answer's body: 32 MiB. The largest answer the contract allows is
/// a `/v1/feed` page of 500 items; the simulator's and the benchmarks' items are about 1 KB,
/// so a page is about 0.5 MB, and an item sent alone in a webhook may reach the wire file's
/// 1 MiB body. 32 MiB holds a page of 500 items of 64 KB each, or 32 items at that 1 MiB: a
/// few times what a page can hold in practice, while an answer past it is an upstream that
/// does not follow the contract, and is read no further.
pub const DEFAULT_MAX_ANSWER_BYTES: u64 = 32 * 1024 * 1024;

impl Default for OutboundPolicy {
    /// https to public addresses only, answers bounded by [`DEFAULT_MAX_ANSWER_BYTES`].
    fn default() -> Self {
        Self {
            allow_http: false,
            allow_private: false,
            allowed_networks: Vec::new(),
            max_answer_bytes: DEFAULT_MAX_ANSWER_BYTES,
        }
    }
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
        max_answer_bytes: DEFAULT_MAX_ANSWER_BYTES,
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
            ..OutboundPolicy::default()
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
            ..OutboundPolicy::default()
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
            ..OutboundPolicy::default()
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
