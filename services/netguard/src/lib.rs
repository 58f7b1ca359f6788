//! Where the relay may send requests on a tenant's behalf (the upstream's API, with the
//! tenant's key): public addresses over https, unless the operator allows more.
//!
//! # Layout
//! - [`policy`]: pure: which addresses are refused (relay-rules' [`classify`], re-exported
//!   here) and whether a URL may be registered or requested ([`OutboundPolicy::check_url`]).
//! - [`client`]: the IO side: a DNS resolver that drops refused addresses after resolution
//!   ([`GuardedResolver`]), and the HTTP client every outbound call goes through
//!   ([`GuardedClient`]): the resolver, no redirects, literal addresses checked before sending.
//! - [`tls`]: whom the relay trusts over TLS ([`TrustRoots`]: the platform's roots and the
//!   operator's CA file), and what a failed connection says ([`error_chain`],
//!   [`certificate_failure`]). Every TLS client of the relay's (upstream, brokers, Postgres,
//!   Redis) takes its roots from here.
//! - [`retry`]: the one retry policy for upstream and broker calls ([`RetryPolicy`]).
//! - [`OutboundArgs`], [`TlsArgs`]: the operator's settings, as flags and environment variables.

mod client;
mod policy;
mod retry;
mod tls;

pub use client::{refusal_in, GuardedClient, GuardedResolver, ResolveError};
pub use policy::{OutboundPolicy, Refusal};
pub use relay_rules::{classify, AddressKind};
pub use retry::{Pauses, RetryPolicy};
pub use tls::{
    certificate_failure, error_chain, CertificateFailure, TlsArgs, TrustError, TrustRoots,
};

/// The operator's settings for outbound requests. All off by default: https to public
/// addresses only.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct OutboundArgs {
    /// Allow plain http:// upstream URLs (tests and the simulator; never in production: the
    /// tenant's API key would cross the network in the clear).
    #[arg(long, env = "RELAY_UPSTREAM_ALLOW_HTTP", global = true)]
    pub upstream_allow_http: bool,
    /// Allow upstream URLs that name or resolve to loopback, private, link-local (cloud
    /// metadata) and other non-public addresses (tests and the simulator on 127.0.0.1).
    #[arg(long, env = "RELAY_UPSTREAM_ALLOW_PRIVATE", global = true)]
    pub upstream_allow_private: bool,
    /// Non-public networks upstream URLs may reach, comma-separated CIDRs (`10.1.2.0/24`,
    /// `127.0.0.2/32`), while every other non-public address stays refused: an upstream, or a
    /// proxy to it, on a private network of the operator's.
    #[arg(
        long,
        env = "RELAY_UPSTREAM_ALLOW_NETWORKS",
        global = true,
        value_delimiter = ','
    )]
    pub upstream_allow_networks: Vec<ipnet::IpNet>,
}

impl OutboundArgs {
    pub fn policy(&self) -> OutboundPolicy {
        OutboundPolicy {
            allow_http: self.upstream_allow_http,
            allow_private: self.upstream_allow_private,
            allowed_networks: self.upstream_allow_networks.clone(),
        }
    }
}
