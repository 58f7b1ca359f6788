//! Who a connection's client is, and how many connections and requests each client holds.
//!
//! The client is the peer that connected, unless that peer is a proxy the operator trusts
//! ([`TrustedProxies`]): then the client is the address the proxy names, in a PROXY protocol v2
//! header at the start of the connection ([`ClientAddressFrom::ProxyProtocol`]) or in each
//! request's `X-Forwarded-For` ([`ClientAddressFrom::ForwardedFor`]). Nobody else can name a
//! client: a header or preface from a peer outside the trusted networks is not read as one.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::HeaderMap;
use ipnet::IpNet;
use tokio::io::AsyncReadExt as _;
use tokio::net::TcpStream;

/// Where a listener learns its clients' addresses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ClientAddressFrom {
    /// The connection's peer (no proxy in front, or one that keeps the client's address).
    #[default]
    Peer,
    /// A PROXY protocol v2 header that a trusted proxy sends first on each connection (AWS NLB,
    /// HAProxy `send-proxy-v2`, ...).
    ProxyProtocol,
    /// The `X-Forwarded-For` header of each request a trusted proxy forwards (an HTTP load
    /// balancer or ingress controller).
    ForwardedFor,
}

impl ClientAddressFrom {
    /// The setting's values: `peer`, `proxy-protocol`, `x-forwarded-for`.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "peer" => Some(Self::Peer),
            "proxy-protocol" => Some(Self::ProxyProtocol),
            "x-forwarded-for" => Some(Self::ForwardedFor),
            _ => None,
        }
    }
}

impl std::str::FromStr for ClientAddressFrom {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        Self::parse(text)
            .ok_or_else(|| format!("{text:?}: one of peer, proxy-protocol, x-forwarded-for"))
    }
}

/// The networks whose peers may name another client: the operator's proxies. Empty (the
/// default): every client is its peer.
#[derive(Debug, Clone, Default)]
pub struct TrustedProxies(Arc<[IpNet]>);

impl TrustedProxies {
    pub fn new(networks: Vec<IpNet>) -> Self {
        Self(networks.into())
    }

    pub fn trusts(&self, address: IpAddr) -> bool {
        let address = canonical(address);
        self.0.iter().any(|network| network.contains(&address))
    }

    /// The client a request names in `X-Forwarded-For` (every such header, in order): the last
    /// address that is not a trusted proxy, since each proxy appends the peer it took the request
    /// from and only the trusted ones can be believed. `peer` when the header is absent or
    /// names only trusted proxies, or when an entry a trusted proxy appended is not an address.
    /// Entries are split on the header's bytes: one that is not ASCII text is an entry that is
    /// not an address, and the addresses a proxy appended after it on the same line still count
    /// (taking the whole line for absent would make its client the proxy).
    pub fn forwarded_client(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        let entries: Vec<&[u8]> = headers
            .get_all("x-forwarded-for")
            .iter()
            .flat_map(|value| value.as_bytes().split(|&byte| byte == b','))
            .collect();
        let mut client = peer;
        for entry in entries.iter().rev() {
            match parse_forwarded_address(entry) {
                Some(address) => {
                    client = canonical(address);
                    if !self.trusts(address) {
                        break;
                    }
                }
                None => break,
            }
        }
        client
    }
}

/// An `X-Forwarded-For` entry: an address, possibly with a port (`1.2.3.4:5`, `[::1]:5`), and
/// spaces around it.
fn parse_forwarded_address(entry: &[u8]) -> Option<IpAddr> {
    let entry = std::str::from_utf8(entry).ok()?.trim();
    if let Ok(address) = entry.parse::<IpAddr>() {
        return Some(address);
    }
    entry.parse::<SocketAddr>().ok().map(|s| s.ip())
}

/// IPv4-mapped IPv6 addresses (`::ffff:1.2.3.4`, as a dual-stack socket reports IPv4 peers)
/// as the IPv4 address, so one client is one key and the trusted networks match either way.
pub fn canonical(address: IpAddr) -> IpAddr {
    match address {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

/// The 12 bytes a PROXY protocol v2 header begins with.
const PROXY_V2_SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";
/// The most a header may carry after its first 16 bytes: the addresses and whatever TLVs the
/// proxy adds (a few hundred bytes in practice). A larger one is not read.
const PROXY_V2_MAX_REST: usize = 4096;

/// Why a PROXY protocol v2 header could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProxyHeaderError {
    #[error("the connection does not begin with a PROXY protocol v2 signature")]
    Signature,
    #[error("PROXY protocol version {0} (only 2 is read)")]
    Version(u8),
    #[error("PROXY protocol command {0} (only LOCAL and PROXY exist)")]
    Command(u8),
    #[error(
        "a PROXY protocol header of {0} bytes (at most {PROXY_V2_MAX_REST} after its first 16)"
    )]
    TooLong(usize),
    #[error("a PROXY protocol header too short for its addresses")]
    Truncated,
    #[error("reading the PROXY protocol header: {0}")]
    Read(String),
    #[error("the PROXY protocol header did not arrive in time")]
    Timeout,
}

/// The first 16 bytes of a v2 header: whether it is a PROXY (not LOCAL) command, the address
/// family byte, and how many bytes follow.
fn proxy_v2_preamble(head: &[u8; 16]) -> Result<(bool, u8, usize), ProxyHeaderError> {
    if head[..12] != PROXY_V2_SIGNATURE {
        return Err(ProxyHeaderError::Signature);
    }
    let version = head[12] >> 4;
    if version != 2 {
        return Err(ProxyHeaderError::Version(version));
    }
    let proxied = match head[12] & 0x0f {
        0 => false,
        1 => true,
        other => return Err(ProxyHeaderError::Command(other)),
    };
    let rest = usize::from(u16::from_be_bytes([head[14], head[15]]));
    if rest > PROXY_V2_MAX_REST {
        return Err(ProxyHeaderError::TooLong(rest));
    }
    Ok((proxied, head[13], rest))
}

/// The source address a PROXY command names for `family` (TCP or UDP over IPv4 or IPv6), from
/// the bytes after the preamble. `None` for families that carry no IP address (UNSPEC, UNIX):
/// the connection's peer stands for the client then.
fn proxy_v2_source(family: u8, rest: &[u8]) -> Result<Option<IpAddr>, ProxyHeaderError> {
    match family >> 4 {
        1 => Ok(Some(IpAddr::V4(Ipv4Addr::from(source::<4>(rest, 12)?)))),
        2 => Ok(Some(IpAddr::V6(Ipv6Addr::from(source::<16>(rest, 36)?)))),
        _ => Ok(None),
    }
}

/// The source address's `N` bytes, first of an address block of `block` bytes (source and
/// destination addresses and ports), which `rest` must hold whole.
fn source<const N: usize>(rest: &[u8], block: usize) -> Result<[u8; N], ProxyHeaderError> {
    match (rest.get(..N), rest.len() >= block) {
        (Some(bytes), true) => Ok(bytes.try_into().expect("N bytes")),
        _ => Err(ProxyHeaderError::Truncated),
    }
}

/// Reads the PROXY protocol v2 header a trusted proxy sends first, exactly (nothing of the
/// request after it), within `timeout`: the client it names, or `peer` for a LOCAL command (the
/// proxy's own health check) or an address family without an IP address.
pub async fn read_proxy_header(
    stream: &mut TcpStream,
    peer: IpAddr,
    timeout: Duration,
) -> Result<IpAddr, ProxyHeaderError> {
    let read = async {
        let mut head = [0u8; 16];
        stream
            .read_exact(&mut head)
            .await
            .map_err(|e| ProxyHeaderError::Read(e.to_string()))?;
        let (proxied, family, rest_len) = proxy_v2_preamble(&head)?;
        let mut rest = vec![0u8; rest_len];
        stream
            .read_exact(&mut rest)
            .await
            .map_err(|e| ProxyHeaderError::Read(e.to_string()))?;
        if !proxied {
            return Ok(peer);
        }
        Ok(proxy_v2_source(family, &rest)?.map_or(peer, canonical))
    };
    tokio::time::timeout(timeout, read)
        .await
        .map_err(|_| ProxyHeaderError::Timeout)?
}

/// How many of something (connections, connections without a head, requests) each client
/// holds, bounded per client. A client's entry goes when it holds none, so the map holds only
/// clients with something open.
#[derive(Clone)]
pub(crate) struct PerClient {
    limit: usize,
    held: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

/// One held place of a client's, given back when dropped.
pub(crate) struct ClientSlot {
    address: IpAddr,
    held: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

impl PerClient {
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            limit: limit.max(1),
            held: Arc::default(),
        }
    }

    /// A place for one more of `address`'s, unless it holds its limit.
    pub(crate) fn admit(&self, address: IpAddr) -> Option<ClientSlot> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let count = held.entry(address).or_default();
        if *count >= self.limit {
            return None;
        }
        *count += 1;
        Some(ClientSlot {
            address,
            held: self.held.clone(),
        })
    }

    #[cfg(test)]
    fn clients(&self) -> usize {
        self.held.lock().unwrap().len()
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = held.get_mut(&self.address) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.address);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn proxies(networks: &[&str]) -> TrustedProxies {
        TrustedProxies::new(networks.iter().map(|n| n.parse().unwrap()).collect())
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn the_client_is_the_last_address_no_trusted_proxy_added() {
        let trusted = proxies(&["10.0.0.0/8"]);
        let peer = ip("10.0.0.5");
        let headers = |values: &[&str]| {
            let mut headers = HeaderMap::new();
            for value in values {
                headers.append("x-forwarded-for", HeaderValue::from_str(value).unwrap());
            }
            headers
        };
        // The client forged an entry; the balancer appended the real one.
        assert_eq!(
            trusted.forwarded_client(peer, &headers(&["6.6.6.6, 203.0.113.7"])),
            ip("203.0.113.7")
        );
        // Through two trusted proxies, over two headers.
        assert_eq!(
            trusted.forwarded_client(peer, &headers(&["203.0.113.7", "10.1.1.1"])),
            ip("203.0.113.7")
        );
        assert_eq!(
            trusted.forwarded_client(peer, &headers(&["[2001:db8::1]:443"])),
            ip("2001:db8::1")
        );
        // Only trusted entries: the first of them; none: the peer.
        assert_eq!(
            trusted.forwarded_client(peer, &headers(&["10.2.2.2"])),
            ip("10.2.2.2")
        );
        assert_eq!(trusted.forwarded_client(peer, &headers(&[])), peer);
        // Garbage where the trusted proxy's entry should be: the peer, never a guess.
        assert_eq!(
            trusted.forwarded_client(peer, &headers(&["203.0.113.7, nonsense"])),
            peer
        );
        // Bytes that are not ASCII text are such garbage, wherever they are: the client's in
        // front of the balancer's entry on the same line do not hide that entry.
        let raw = |value: &[u8]| {
            let mut headers = HeaderMap::new();
            headers.append("x-forwarded-for", HeaderValue::from_bytes(value).unwrap());
            headers
        };
        assert_eq!(
            trusted.forwarded_client(peer, &raw(b"6.6.6.\xe9, 203.0.113.7")),
            ip("203.0.113.7")
        );
        assert_eq!(
            trusted.forwarded_client(peer, &raw(b"\xff\xfe,203.0.113.7 ")),
            ip("203.0.113.7")
        );
        assert_eq!(
            trusted.forwarded_client(peer, &raw(b"203.0.113.7, 10.1.\xe9.1")),
            peer
        );
        assert!(trusted.trusts(ip("::ffff:10.9.9.9")));
        assert!(!trusted.trusts(ip("11.0.0.1")));
    }

    fn v2_header(command: u8, family: u8, rest: &[u8]) -> Vec<u8> {
        let mut header = PROXY_V2_SIGNATURE.to_vec();
        header.push(0x20 | command);
        header.push(family);
        header.extend_from_slice(&(rest.len() as u16).to_be_bytes());
        header.extend_from_slice(rest);
        header
    }

    fn parse(header: &[u8]) -> Result<Option<IpAddr>, ProxyHeaderError> {
        let head: [u8; 16] = header[..16].try_into().unwrap();
        let (proxied, family, rest) = proxy_v2_preamble(&head)?;
        assert_eq!(rest, header.len() - 16);
        if !proxied {
            return Ok(None);
        }
        proxy_v2_source(family, &header[16..])
    }

    #[test]
    fn proxy_protocol_v2_headers_are_read_and_bad_ones_refused() {
        let mut v4 = vec![203, 0, 113, 7, 10, 0, 0, 1];
        v4.extend_from_slice(&[0x1f, 0x90, 0x01, 0xbb]);
        assert_eq!(parse(&v2_header(1, 0x11, &v4)), Ok(Some(ip("203.0.113.7"))));
        let mut v6 = ip6_bytes("2001:db8::7").to_vec();
        v6.extend_from_slice(&ip6_bytes("2001:db8::1"));
        v6.extend_from_slice(&[0, 1, 0, 2]);
        // TLVs after the addresses are skipped.
        v6.extend_from_slice(&[0x04, 0x00, 0x01, 0xaa]);
        assert_eq!(parse(&v2_header(1, 0x21, &v6)), Ok(Some(ip("2001:db8::7"))));
        // LOCAL (a health check) and UNSPEC name no client.
        assert_eq!(parse(&v2_header(0, 0x00, &[])), Ok(None));
        assert_eq!(parse(&v2_header(1, 0x00, &[])), Ok(None));
        assert_eq!(
            parse(&v2_header(1, 0x11, &v4[..6])),
            Err(ProxyHeaderError::Truncated)
        );
        assert_eq!(
            parse(&v2_header(3, 0x11, &v4)),
            Err(ProxyHeaderError::Command(3))
        );
        let mut v1 = v2_header(1, 0x11, &v4);
        v1[12] = 0x11;
        assert_eq!(parse(&v1), Err(ProxyHeaderError::Version(1)));
        let http = b"POST /webhooks/x HTTP/1.1\r\n\r\n";
        assert_eq!(parse(http), Err(ProxyHeaderError::Signature));
        let mut long = v2_header(1, 0x11, &v4);
        long[14..16].copy_from_slice(&5000u16.to_be_bytes());
        let head: [u8; 16] = long[..16].try_into().unwrap();
        assert_eq!(
            proxy_v2_preamble(&head),
            Err(ProxyHeaderError::TooLong(5000))
        );
    }

    fn ip6_bytes(text: &str) -> [u8; 16] {
        text.parse::<Ipv6Addr>().unwrap().octets()
    }

    #[tokio::test]
    async fn a_proxy_header_is_read_exactly_and_the_request_after_it_is_left() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let mut v4 = vec![198, 51, 100, 9, 127, 0, 0, 1];
        v4.extend_from_slice(&[0, 80, 0, 80]);
        let mut sent = v2_header(1, 0x11, &v4);
        sent.extend_from_slice(b"GET / HTTP/1.1\r\n");
        let client = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt as _;
            let mut stream = TcpStream::connect(address).await.unwrap();
            stream.write_all(&sent).await.unwrap();
            stream
        });
        let (mut stream, peer) = listener.accept().await.unwrap();
        let client_address = read_proxy_header(&mut stream, peer.ip(), Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(client_address, ip("198.51.100.9"));
        let mut rest = [0u8; 16];
        stream.read_exact(&mut rest).await.unwrap();
        assert_eq!(&rest, b"GET / HTTP/1.1\r\n");
        drop(client.await.unwrap());
    }

    #[test]
    fn a_client_holds_at_most_its_limit_and_its_entry_goes_with_its_last_slot() {
        let per_client = PerClient::new(2);
        let (a, b) = (ip("192.0.2.1"), ip("192.0.2.2"));
        let first = per_client.admit(a).unwrap();
        let second = per_client.admit(a).unwrap();
        assert!(per_client.admit(a).is_none());
        let other = per_client.admit(b).unwrap();
        assert_eq!(per_client.clients(), 2);
        drop(first);
        let third = per_client.admit(a).unwrap();
        drop((second, third, other));
        assert_eq!(per_client.clients(), 0);
    }
}
