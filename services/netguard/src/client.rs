//! The policy carried out on every outbound request: after name resolution (so a name that
//! resolves to a refused address, now or after a DNS change, reaches nothing), and before sending
//! to a literal address (reqwest connects to those without asking the resolver); and on every
//! answer: its body read up to the policy's `max_answer_bytes`, never further.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use reqwest::{Method, RequestBuilder, Response};

use crate::policy::{OutboundPolicy, Refusal};
use crate::tls::{error_chain, TrustRoots};

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
/// must see the address connected to), and https only unless the operator allows http. Its
/// callers read every answer's body with [`GuardedClient::read_body`], which stops at the
/// policy's `max_answer_bytes`.
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

    /// The most bytes of an answer's body [`GuardedClient::read_body`] reads.
    pub fn max_answer_bytes(&self) -> u64 {
        self.policy.max_answer_bytes
    }

    /// `response`'s body, read chunk by chunk up to the policy's `max_answer_bytes` (see
    /// [`read_capped`]).
    pub async fn read_body(&self, response: Response) -> Result<Vec<u8>, BodyError> {
        read_capped(response, self.policy.max_answer_bytes).await
    }

    /// [`GuardedClient::read_body`] with a lower cap: `cap` when it is below the policy's.
    pub async fn read_body_within(
        &self,
        response: Response,
        cap: u64,
    ) -> Result<Vec<u8>, BodyError> {
        read_capped(response, cap.min(self.policy.max_answer_bytes)).await
    }
}

/// An answer's body that was not read whole.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// Longer than the cap: by its declared length (`declared`, nothing read), or by the bytes
    /// that came (`declared` is `None` when it declared none).
    #[error("the answer is larger than {cap} bytes{}", match .declared {
        Some(declared) => format!(" (it declares {declared})"),
        None => String::new(),
    })]
    TooLarge { cap: u64, declared: Option<u64> },
    /// The connection failed or timed out while the body came.
    #[error("reading the answer: {}", error_chain(.0))]
    Read(reqwest::Error),
}

impl BodyError {
    /// The failure's name for users: `too_large`, or the read's (`timeout`, `body`, ...).
    pub fn kind(&self) -> &'static str {
        match self {
            BodyError::TooLarge { .. } => "too_large",
            BodyError::Read(error) if error.is_timeout() => "timeout",
            BodyError::Read(_) => "body",
        }
    }
}

/// Reads `response`'s body whole, at most `cap` bytes: refused at once when its declared length
/// is over the cap, and as soon as the bytes that came pass it. The buffer grows with what
/// comes (doubling, never past the cap), never from a length the answer claims, so an answer
/// costs at most `cap` bytes of memory whatever it says. The client's timeout bounds how long
/// the body may take.
pub async fn read_capped(mut response: Response, cap: u64) -> Result<Vec<u8>, BodyError> {
    if let Some(declared) = response.content_length().filter(|&declared| declared > cap) {
        return Err(BodyError::TooLarge {
            cap,
            declared: Some(declared),
        });
    }
    let limit = usize::try_from(cap).unwrap_or(usize::MAX);
    let mut body: Vec<u8> = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(BodyError::Read)? {
        let len = body.len().saturating_add(chunk.len());
        if len > limit {
            return Err(BodyError::TooLarge {
                cap,
                declared: None,
            });
        }
        if len > body.capacity() {
            let grown = body.capacity().saturating_mul(2).clamp(len, limit);
            body.reserve_exact(grown - body.len());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
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
            ..OutboundPolicy::default()
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

    /// Serves one connection on 127.0.0.1 with `head` (status line and headers, without the
    /// blank line), then writes what `body` gives until it gives `None` or the client leaves.
    async fn serve_once(
        head: &str,
        mut body: impl FnMut() -> Option<Vec<u8>> + Send + 'static,
    ) -> String {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let head = format!("{head}\r\n\r\n");
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = [0u8; 4096];
            let _ = socket.read(&mut request).await;
            if socket.write_all(head.as_bytes()).await.is_err() {
                return;
            }
            while let Some(part) = body() {
                if socket.write_all(&part).await.is_err() {
                    return;
                }
            }
            // Holds the connection open: the reader must not wait for more.
            tokio::time::sleep(Duration::from_secs(30)).await;
        });
        format!("http://{address}/")
    }

    /// The answer to a GET of `url` through `client`.
    async fn get(client: &GuardedClient, url: &str) -> Response {
        client
            .request(Method::GET, url)
            .unwrap()
            .send()
            .await
            .unwrap()
    }

    /// The answer to a GET of `url` through a client that may reach anything.
    async fn answer(url: &str) -> Response {
        let client = GuardedClient::new(
            OutboundPolicy::ANY,
            &TrustRoots::platform(),
            Duration::from_secs(20),
        )
        .unwrap();
        get(&client, url).await
    }

    /// One chunk of chunked transfer encoding.
    fn chunk(bytes: &[u8]) -> Vec<u8> {
        let mut out = format!("{:x}\r\n", bytes.len()).into_bytes();
        out.extend_from_slice(bytes);
        out.extend_from_slice(b"\r\n");
        out
    }

    #[tokio::test]
    async fn a_declared_length_over_the_cap_is_refused_before_any_byte_is_read() {
        let url = serve_once("HTTP/1.1 200 OK\r\nContent-Length: 1000000000000", || None).await;
        let started = std::time::Instant::now();
        let error = read_capped(answer(&url).await, 1024).await.unwrap_err();
        assert!(
            matches!(
                error,
                BodyError::TooLarge {
                    cap: 1024,
                    declared: Some(1_000_000_000_000)
                }
            ),
            "{error:?}"
        );
        assert_eq!(error.kind(), "too_large");
        // The server sends nothing and keeps the connection: only the declared length refused it.
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(
            error.to_string(),
            "the answer is larger than 1024 bytes (it declares 1000000000000)"
        );
    }

    #[tokio::test]
    async fn a_chunked_body_is_refused_as_soon_as_it_passes_the_cap() {
        // An endless body: 4 KiB chunks for as long as the client reads.
        let url = serve_once("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked", || {
            Some(chunk(&[b'x'; 4096]))
        })
        .await;
        let started = std::time::Instant::now();
        let error = read_capped(answer(&url).await, 64 * 1024)
            .await
            .unwrap_err();
        assert!(
            matches!(
                error,
                BodyError::TooLarge {
                    cap: 65536,
                    declared: None
                }
            ),
            "{error:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn a_body_of_exactly_the_cap_is_read_whole_and_one_byte_more_is_not() {
        let cap = 10_000u64;
        // Declared, exactly at the cap.
        let mut whole = Some(vec![b'a'; cap as usize]);
        let url = serve_once(
            &format!("HTTP/1.1 200 OK\r\nContent-Length: {cap}"),
            move || whole.take(),
        )
        .await;
        let body = read_capped(answer(&url).await, cap).await.unwrap();
        assert_eq!(body, vec![b'a'; cap as usize]);
        // Chunked, exactly at the cap, in uneven parts; then the end.
        let mut parts = vec![
            chunk(&[b'b'; 3000]),
            chunk(&[b'b'; 7000]),
            b"0\r\n\r\n".to_vec(),
        ]
        .into_iter();
        let url = serve_once("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked", move || {
            parts.next()
        })
        .await;
        let body = read_capped(answer(&url).await, cap).await.unwrap();
        assert_eq!(body, vec![b'b'; cap as usize]);
        assert!(body.capacity() <= cap as usize, "{}", body.capacity());
        // One byte past the cap, undeclared.
        let mut parts = vec![chunk(&[b'c'; 10_001]), b"0\r\n\r\n".to_vec()].into_iter();
        let url = serve_once("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked", move || {
            parts.next()
        })
        .await;
        assert!(matches!(
            read_capped(answer(&url).await, cap).await,
            Err(BodyError::TooLarge { declared: None, .. })
        ));
    }

    #[tokio::test]
    async fn the_client_reads_with_its_policys_cap() {
        let policy = OutboundPolicy {
            max_answer_bytes: 100,
            ..OutboundPolicy::ANY
        };
        let client =
            GuardedClient::new(policy, &TrustRoots::platform(), Duration::from_secs(20)).unwrap();
        assert_eq!(client.max_answer_bytes(), 100);
        let url = serve_once("HTTP/1.1 200 OK\r\nContent-Length: 101", || None).await;
        let response = get(&client, &url).await;
        assert!(matches!(
            client.read_body(response).await,
            Err(BodyError::TooLarge { cap: 100, .. })
        ));
        // A lower cap of the caller's is taken; a higher one is not.
        let mut whole = Some(vec![b'd'; 60]);
        let url = serve_once("HTTP/1.1 200 OK\r\nContent-Length: 60", move || {
            whole.take()
        })
        .await;
        let response = get(&client, &url).await;
        assert!(matches!(
            client.read_body_within(response, 50).await,
            Err(BodyError::TooLarge { cap: 50, .. })
        ));
        let url = serve_once("HTTP/1.1 200 OK\r\nContent-Length: 101", || None).await;
        let response = get(&client, &url).await;
        assert!(matches!(
            client.read_body_within(response, 1000).await,
            Err(BodyError::TooLarge { cap: 100, .. })
        ));
    }
}
