//! TLS for the tests: a CA of the test's own (rcgen), certificates it signs for this machine's
//! names, the CA as the PEM file an operator would give `RELAY_TLS_CA_FILE`, and a
//! TLS-terminating proxy that puts a real TLS listener in front of a plain service (RabbitMQ,
//! Redis) for the length of a test.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
use relay_netguard::TrustRoots;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_rustls::rustls;

/// A certificate authority made for one test.
pub struct TestCa {
    certificate: rcgen::Certificate,
    key: KeyPair,
    dir: PathBuf,
}

/// A server's certificate and key, as PEM.
#[derive(Clone)]
pub struct ServerIdentity {
    pub certificate_pem: String,
    pub key_pem: String,
}

impl TestCa {
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("relay test CA {name}"));
        let key = KeyPair::generate().expect("a CA key");
        let certificate = params.self_signed(&key).expect("a self-signed CA");
        let dir = std::env::temp_dir().join(format!("relay-tls-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        Self {
            certificate,
            key,
            dir,
        }
    }

    /// A certificate for `names` (host names or literal addresses), valid now, signed by
    /// this CA.
    pub fn issue(&self, names: &[&str]) -> ServerIdentity {
        self.issue_with(names, |_| {})
    }

    /// A certificate for `names` that expired yesterday.
    pub fn issue_expired(&self, names: &[&str]) -> ServerIdentity {
        self.issue_with(names, |params| {
            let now = time::OffsetDateTime::now_utc();
            params.not_before = now - time::Duration::days(30);
            params.not_after = now - time::Duration::days(1);
        })
    }

    fn issue_with(
        &self,
        names: &[&str],
        adjust: impl FnOnce(&mut CertificateParams),
    ) -> ServerIdentity {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut params = CertificateParams::new(names).expect("server params");
        params
            .distinguished_name
            .push(DnType::CommonName, "relay test server");
        adjust(&mut params);
        let key = KeyPair::generate().expect("a server key");
        let certificate = params
            .signed_by(&key, &self.certificate, &self.key)
            .expect("a signed server certificate");
        ServerIdentity {
            certificate_pem: certificate.pem(),
            key_pem: key.serialize_pem(),
        }
    }

    /// The CA's certificate in a PEM file, as an operator gives it to `RELAY_TLS_CA_FILE`.
    pub fn pem_file(&self) -> PathBuf {
        let path = self.dir.join("ca.pem");
        if !path.exists() {
            std::fs::write(&path, self.certificate.pem()).expect("writing the CA file");
        }
        path
    }

    /// The roots the relay trusts when the operator gives it this CA's file.
    pub fn trust(&self) -> TrustRoots {
        TrustRoots::load(Some(&self.pem_file())).expect("the test CA loads")
    }
}

impl Drop for TestCa {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl ServerIdentity {
    /// A rustls server configuration presenting this certificate.
    pub fn server_config(&self) -> Arc<rustls::ServerConfig> {
        use rustls::pki_types::pem::PemObject as _;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let chain: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(self.certificate_pem.as_bytes())
                .collect::<Result<_, _>>()
                .expect("the certificate parses");
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes()).expect("the key parses");
        Arc::new(
            rustls::ServerConfig::builder()
                .with_no_client_auth()
                .with_single_cert(chain, key)
                .expect("a server configuration"),
        )
    }
}

/// A TLS listener on 127.0.0.1 in front of a plain TCP service: each connection's TLS is
/// ended here and its bytes carried to `target` and back. Stops when dropped.
pub struct TlsProxy {
    pub address: SocketAddr,
    task: JoinHandle<()>,
}

impl TlsProxy {
    pub async fn start(identity: &ServerIdentity, target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("binding");
        let address = listener.local_addr().unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(identity.server_config());
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let acceptor = acceptor.clone();
                connections.spawn(async move {
                    // A client that refuses the certificate ends its handshake here.
                    let Ok(mut client) = acceptor.accept(client).await else {
                        return;
                    };
                    let Ok(mut server) = TcpStream::connect(target).await else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                });
            }
        });
        Self { address, task }
    }
}

impl Drop for TlsProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
