//! Where the relay may send requests on a tenant's behalf (the upstream's API, with the
//! tenant's key): public addresses over https, unless the operator allows more.
//!
//! # Layout
//! - [`policy`]: pure: which addresses are refused (relay-rules' [`classify`], re-exported
//!   here) and whether a URL may be registered or requested ([`OutboundPolicy::check_url`]).
//! - [`client`]: the IO side: a DNS resolver that drops refused addresses after resolution
//!   ([`GuardedResolver`]), and the HTTP client every outbound call goes through
//!   ([`GuardedClient`]): the resolver, no redirects, literal addresses checked before sending,
//!   and every answer's body read chunk by chunk up to a cap ([`GuardedClient::read_body`]).
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

pub use client::{
    read_capped, refusal_in, BodyError, GuardedClient, GuardedResolver, ResolveError,
};
pub use policy::{OutboundPolicy, Refusal, DEFAULT_MAX_ANSWER_BYTES};
pub use relay_rules::{classify, AddressKind};
pub use retry::{Pauses, RetryPolicy};
pub use tls::{
    certificate_failure, error_chain, CertificateFailure, TlsArgs, TrustError, TrustRoots,
};

/// The operator's settings for outbound requests. All off by default: https to public
/// addresses only, answers bounded by [`DEFAULT_MAX_ANSWER_BYTES`].
#[derive(Debug, Clone, clap::Args)]
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
    /// The most bytes of one upstream answer's body the relay reads (32 MiB: a few times the
    /// largest `/v1/feed` page the contract allows, see `DEFAULT_MAX_ANSWER_BYTES`). Past it
    /// the read fails as `too_large` (the endpoint's state says so), and what it read is let
    /// go: a tenant's upstream cannot make the sequencer or the control plane hold more.
    #[arg(
        long,
        env = "RELAY_UPSTREAM_MAX_ANSWER_BYTES",
        global = true,
        default_value_t = DEFAULT_MAX_ANSWER_BYTES,
        value_parser = clap::value_parser!(u64).range(1024..)
    )]
    pub upstream_max_answer_bytes: u64,
}

impl Default for OutboundArgs {
    fn default() -> Self {
        Self {
            upstream_allow_http: false,
            upstream_allow_private: false,
            upstream_allow_networks: Vec::new(),
            upstream_max_answer_bytes: DEFAULT_MAX_ANSWER_BYTES,
        }
    }
}

impl OutboundArgs {
    pub fn policy(&self) -> OutboundPolicy {
        OutboundPolicy {
            allow_http: self.upstream_allow_http,
            allow_private: self.upstream_allow_private,
            allowed_networks: self.upstream_allow_networks.clone(),
            max_answer_bytes: self.upstream_max_answer_bytes,
        }
    }
}
