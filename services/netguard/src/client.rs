//! The policy carried out on every outbound request: after name resolution (so a name that
//! resolves to a refused address, now or after a DNS change, reaches nothing), and before sending
//! to a literal address (reqwest connects to those without asking the resolver).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use reqwest::{Method, RequestBuilder};

use crate::policy::{OutboundPolicy, Refusal};
use crate::tls::TrustRoots;

/// Resolves with the system's resolver, then keeps only the addresses the policy allows. A name
/// with none left fails to resolve, so nothing is sent.
#[derive(Debug, Clone)]
pub struct GuardedResolver {
    policy: OutboundPolicy,
}

impl GuardedResolver {
    pub fn new(policy: OutboundPolicy) -> Self {
        Self { policy }
    }

    /// `host`'s addresses that the policy allows (ports 0: the caller's URL gives the port).
    pub async fn resolve_host(&self, host: &str) -> Result<Vec<SocketAddr>, ResolveError> {
        self.policy.check_name(host)?;
        let resolved: Vec<SocketAddr> = tokio::net::lookup_host((host, 0))
            .await
            .map_err(ResolveError::Lookup)?
            .collect();
        Ok(self.policy.allowed_addresses(host, resolved)?)
    }
}

impl OutboundPolicy {
    /// What `host` resolved to, less what the policy refuses; an error when nothing is left
    /// (naming the first refused address).
    pub fn allowed_addresses(
        &self,
        host: &str,
        resolved: Vec<SocketAddr>,
    ) -> Result<Vec<SocketAddr>, Refusal> {
        let mut refused = None;
        let allowed: Vec<SocketAddr> = resolved
            .into_iter()
            .filter(|address| match self.check_address(address.ip()) {
                Ok(()) => true,
                Err(refusal) => {
                    refused.get_or_insert(refusal);
                    false
                }
            })
            .collect();
        if allowed.is_empty() {
            return Err(refused.unwrap_or_else(|| Refusal::NoPublicAddress(host.to_owned())));
        }
        Ok(allowed)
    }
}

/// The policy's refusal behind a failed request, if that is why it failed (reqwest wraps the
/// resolver's error in its own).
pub fn refusal_in<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a Refusal> {
    let mut next = Some(error);
    while let Some(error) = next {
        if let Some(ResolveError::Refused(refusal)) = error.downcast_ref::<ResolveError>() {
            return Some(refusal);
        }
        if let Some(refusal) = error.downcast_ref::<Refusal>() {
            return Some(refusal);
        }
        next = error.source();
    }
    None
}

/// A name that could not be resolved, or resolved only to refused addresses.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("{0}")]
    Refused(#[from] Refusal),
    #[error("resolving: {0}")]
    Lookup(#[source] std::io::Error),
}

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let resolver = self.clone();
        Box::pin(async move {
            let addresses = resolver.resolve_host(name.as_str()).await?;
            Ok(Box::new(addresses.into_iter()) as Addrs)
        })
    }
}

/// The HTTP client for requests to where a tenant pointed the relay: names resolved by
/// [`GuardedResolver`], literal addresses checked before sending, no redirect followed (one
/// would send the tenant's key wherever it points, past these checks), no proxy (the checks
/// must see the address connected to), and https only unless the operator allows http.
#[derive(Debug, Clone)]
pub struct GuardedClient {
    http: reqwest::Client,
    policy: OutboundPolicy,
}

impl GuardedClient {
    /// A client whose every request, connecting included, ends within `timeout`, trusting
    /// `trust`'s roots for https.
    pub fn new(
        policy: OutboundPolicy,
        trust: &TrustRoots,
        timeout: Duration,
    ) -> Result<Self, reqwest::Error> {
        let http = reqwest::Client::builder()
            .use_preconfigured_tls(trust.client_config())
            .timeout(timeout)
            .connect_timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .https_only(!policy.allow_http)
            .dns_resolver(Arc::new(GuardedResolver::new(policy.clone())))
            .build()?;
        Ok(Self { http, policy })
    }

    pub fn policy(&self) -> &OutboundPolicy {
        &self.policy
    }

    /// A request to `url`, or why the policy refuses it.
    pub fn request(&self, method: Method, url: &str) -> Result<RequestBuilder, Refusal> {
        let url = self.policy.check_url(url)?;
        Ok(self.http.request(method, url))
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;

    #[tokio::test]
    async fn a_name_for_loopback_resolves_to_nothing_unless_allowed() {
        let strict = GuardedResolver::new(OutboundPolicy::default());
        for name in ["localhost", "ip6-localhost"] {
            match strict.resolve_host(name).await {
                Err(ResolveError::Refused(_)) => {}
                // Not every machine's /etc/hosts names ip6-localhost.
                Err(ResolveError::Lookup(_)) if name != "localhost" => {}
                other => panic!("{name}: {other:?}"),
            }
        }
        let open = GuardedResolver::new(OutboundPolicy::ANY);
        let addresses = open.resolve_host("localhost").await.unwrap();
        assert!(
            addresses.iter().all(|a| a.ip().is_loopback()),
            "{addresses:?}"
        );
    }

    #[test]
    fn what_a_name_resolves_to_is_filtered_and_nothing_left_is_an_error() {
        let strict = OutboundPolicy::default();
        let at = |text: &str| SocketAddr::new(text.parse::<IpAddr>().unwrap(), 0);
        assert_eq!(
            strict
                .allowed_addresses("mixed", vec![at("10.0.0.1"), at("8.8.8.8"), at("::1")])
                .unwrap(),
            vec![at("8.8.8.8")]
        );
        match strict.allowed_addresses("rebound", vec![at("169.254.169.254"), at("127.0.0.1")]) {
            Err(Refusal::Address { address, .. }) => {
                assert_eq!(address, at("169.254.169.254").ip())
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            strict.allowed_addresses("empty", vec![]),
            Err(Refusal::NoPublicAddress("empty".to_owned()))
        );
        assert_eq!(
            OutboundPolicy::ANY
                .allowed_addresses("local", vec![at("127.0.0.1")])
                .unwrap(),
            vec![at("127.0.0.1")]
        );
    }

    /// A name other than `localhost` that this machine's hosts file maps to a loopback
    /// address (most machines have one: their own name), so the lookup itself is exercised.
    fn loopback_alias() -> Option<String> {
        let hosts = std::fs::read_to_string("/etc/hosts").ok()?;
        hosts.lines().find_map(|line| {
            let mut words = line.split('#').next()?.split_whitespace();
            let address: IpAddr = words.next()?.parse().ok()?;
            if !address.is_loopback() {
                return None;
            }
            words
                .find(|name| OutboundPolicy::default().check_name(name).is_ok())
                .map(str::to_owned)
        })
    }

    #[tokio::test]
    async fn a_request_to_a_name_for_loopback_fails_at_connect_with_the_refusal() {
        let Some(name) = loopback_alias() else {
            eprintln!("no loopback alias in /etc/hosts: only the filter's unit test covers this");
            return;
        };
        let strict = GuardedResolver::new(OutboundPolicy::default());
        assert!(
            matches!(
                strict.resolve_host(&name).await,
                Err(ResolveError::Refused(_))
            ),
            "{name}"
        );
        let policy = OutboundPolicy {
            allow_http: true,
            allow_private: false,
            allowed_networks: Vec::new(),
        };
        let client =
            GuardedClient::new(policy, &TrustRoots::platform(), Duration::from_secs(5)).unwrap();
        // The URL passes the pure check (a name), so only the resolver can stop it.
        let error = client
            .request(Method::GET, &format!("http://{name}:1/"))
            .unwrap()
            .send()
            .await
            .unwrap_err();
        let refusal = refusal_in(&error).unwrap_or_else(|| panic!("{name}: {error:?}"));
        assert!(matches!(refusal, Refusal::Address { .. }), "{refusal:?}");
    }

    #[tokio::test]
    async fn a_literal_address_is_refused_before_sending() {
        let client = GuardedClient::new(
            OutboundPolicy::default(),
            &TrustRoots::platform(),
            Duration::from_secs(1),
        )
        .unwrap();
        for url in [
            "https://127.0.0.1:1/x",
            "https://[::1]:1/",
            "https://0x7f000001/",
        ] {
            assert!(
                matches!(
                    client.request(Method::GET, url),
                    Err(Refusal::Address { .. })
                ),
                "{url}"
            );
        }
        assert!(matches!(
            client.request(Method::GET, "http://example.com/"),
            Err(Refusal::HttpsOnly)
        ));
    }
}
