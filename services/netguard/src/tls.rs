//! Whom the relay trusts when it connects over TLS (the upstream's API, the relay's broker and
//! tenants' brokers, Postgres, Redis): the platform's roots, plus the operator's own CA bundle
//! for services behind a private CA. And what a failed connection says: the whole chain of
//! causes, and which certificate check failed, so a tenant reads "unknown issuer" in its
//! endpoint's state rather than "error sending request".

use std::error::Error;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use base64::Engine as _;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rustls::{CertificateError, ClientConfig, RootCertStore};

/// The operator's TLS setting, shared by every client the relay builds.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TlsArgs {
    /// A PEM file of CA certificates trusted beside the platform's roots, for an upstream,
    /// broker, Postgres or Redis whose certificate a private CA signed. Read at start-up.
    #[arg(long, env = "RELAY_TLS_CA_FILE", global = true)]
    pub tls_ca_file: Option<PathBuf>,
}

impl TlsArgs {
    pub fn trust(&self) -> Result<TrustRoots, TrustError> {
        TrustRoots::load(self.tls_ca_file.as_deref())
    }
}

/// The CAs the relay trusts: the platform's (its store of trusted roots, as `openssl` and
/// `curl` read it) and the operator's extra bundle, if any.
#[derive(Clone)]
pub struct TrustRoots {
    roots: Arc<RootCertStore>,
    /// Every root's certificate, platform's and extra, for clients that take one bundle in
    /// place of the platform's (Redis).
    certificates: Arc<Vec<CertificateDer<'static>>>,
    extra: Option<Extra>,
}

#[derive(Clone)]
struct Extra {
    file: PathBuf,
}

impl std::fmt::Debug for TrustRoots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrustRoots")
            .field("roots", &self.roots.len())
            .field("extra", &self.extra.as_ref().map(|e| &e.file))
            .finish()
    }
}

/// Why the trust settings could not be read: the relay refuses to start rather than connect
/// with fewer roots than the operator asked for.
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    #[error("reading the CA file {file}: {source}")]
    Read {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the CA file {file} holds no PEM certificate")]
    Empty { file: PathBuf },
    #[error("the CA file {file}: {detail}")]
    Certificate { file: PathBuf, detail: String },
}

impl TrustRoots {
    /// The platform's roots alone (read once per process).
    pub fn platform() -> Self {
        static PLATFORM: std::sync::OnceLock<TrustRoots> = std::sync::OnceLock::new();
        PLATFORM
            .get_or_init(|| Self::with(platform_certificates(), None))
            .clone()
    }

    /// The platform's roots, and `ca_file`'s certificates beside them.
    pub fn load(ca_file: Option<&Path>) -> Result<Self, TrustError> {
        let Some(file) = ca_file else {
            return Ok(Self::platform());
        };
        let mut certificates = platform_certificates();
        let extra = {
            let pem = std::fs::read_to_string(file).map_err(|source| TrustError::Read {
                file: file.to_owned(),
                source,
            })?;
            let own: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem.as_bytes())
                .collect::<Result<_, _>>()
                .map_err(|e| TrustError::Certificate {
                    file: file.to_owned(),
                    detail: e.to_string(),
                })?;
            if own.is_empty() {
                return Err(TrustError::Empty {
                    file: file.to_owned(),
                });
            }
            // Each of the operator's certificates must be a usable root: one that is not
            // would otherwise be dropped without a word, and the connections it was for
            // would fail as "unknown issuer".
            let mut check = RootCertStore::empty();
            for certificate in &own {
                check
                    .add(certificate.clone())
                    .map_err(|e| TrustError::Certificate {
                        file: file.to_owned(),
                        detail: e.to_string(),
                    })?;
            }
            certificates.extend(own);
            Extra {
                file: file.to_owned(),
            }
        };
        Ok(Self::with(certificates, Some(extra)))
    }

    fn with(certificates: Vec<CertificateDer<'static>>, extra: Option<Extra>) -> Self {
        let mut roots = RootCertStore::empty();
        let (added, ignored) = roots.add_parsable_certificates(certificates.iter().cloned());
        if ignored > 0 {
            tracing::debug!(
                added,
                ignored,
                "platform roots rustls cannot use were left out"
            );
        }
        Self {
            roots: Arc::new(roots),
            certificates: Arc::new(certificates),
            extra,
        }
    }

    /// A rustls client configuration trusting these roots (no client certificate).
    pub fn client_config(&self) -> ClientConfig {
        ClientConfig::builder()
            .with_root_certificates(self.roots.clone())
            .with_no_client_auth()
    }

    /// The operator's CA file, for clients that read the file themselves and add it to the
    /// platform's roots (Postgres' `sslrootcert`).
    pub fn ca_file(&self) -> Option<&Path> {
        self.extra.as_ref().map(|extra| extra.file.as_path())
    }

    /// Every root as one PEM bundle, when the operator gave a CA file (`None`: the platform's
    /// roots alone, which such clients load themselves), for clients whose bundle replaces the
    /// platform's roots rather than adding to them (Redis).
    pub fn bundle_pem(&self) -> Option<Vec<u8>> {
        self.extra.as_ref()?;
        let mut pem = Vec::new();
        for certificate in self.certificates.iter() {
            pem.extend_from_slice(b"-----BEGIN CERTIFICATE-----\n");
            let text = base64::engine::general_purpose::STANDARD.encode(certificate.as_ref());
            for line in text.as_bytes().chunks(64) {
                pem.extend_from_slice(line);
                pem.push(b'\n');
            }
            pem.extend_from_slice(b"-----END CERTIFICATE-----\n");
        }
        Some(pem)
    }
}

/// The platform's trusted roots. A store that cannot be read is logged, not fatal: a relay
/// that talks only to services under the operator's CA needs none of it.
fn platform_certificates() -> Vec<CertificateDer<'static>> {
    let native = rustls_native_certs::load_native_certs();
    for error in &native.errors {
        tracing::warn!(%error, "reading the platform's trusted roots");
    }
    native.certs
}

/// Which check a peer's certificate failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CertificateFailure {
    /// Signed by no CA the relay trusts (self-signed, or a private CA not in the CA file).
    UnknownIssuer,
    /// Valid, but for another name than the one connected to.
    NameMismatch,
    Expired,
    NotYetValid,
    Revoked,
    /// Any other refusal (bad signature, wrong usage, unreadable).
    Invalid,
}

impl CertificateFailure {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::UnknownIssuer => "unknown_issuer",
            Self::NameMismatch => "name_mismatch",
            Self::Expired => "expired",
            Self::NotYetValid => "not_yet_valid",
            Self::Revoked => "revoked",
            Self::Invalid => "invalid",
        }
    }

    /// The failure's name as users read it beside other failures of a call (the endpoint's
    /// state, logs): `certificate_` and [`Self::as_str`].
    pub fn kind(self) -> &'static str {
        match self {
            Self::UnknownIssuer => "certificate_unknown_issuer",
            Self::NameMismatch => "certificate_name_mismatch",
            Self::Expired => "certificate_expired",
            Self::NotYetValid => "certificate_not_yet_valid",
            Self::Revoked => "certificate_revoked",
            Self::Invalid => "certificate_invalid",
        }
    }

    fn of(error: &CertificateError) -> Self {
        match error {
            CertificateError::UnknownIssuer => Self::UnknownIssuer,
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
                Self::NameMismatch
            }
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => Self::Expired,
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                Self::NotYetValid
            }
            CertificateError::Revoked => Self::Revoked,
            _ => Self::Invalid,
        }
    }
}

impl std::fmt::Display for CertificateFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::UnknownIssuer => "the certificate's issuer is not a trusted CA",
            Self::NameMismatch => "the certificate is not valid for the host's name",
            Self::Expired => "the certificate has expired",
            Self::NotYetValid => "the certificate is not valid yet",
            Self::Revoked => "the certificate was revoked",
            Self::Invalid => "the certificate was refused",
        })
    }
}

/// The certificate check behind a failed connection, if that is why it failed. Looks through
/// the whole chain, and inside `std::io::Error`s (whose `source` skips the error they carry).
pub fn certificate_failure(error: &(dyn Error + 'static)) -> Option<CertificateFailure> {
    let mut next = Some(error);
    while let Some(error) = next {
        if let Some(rustls::Error::InvalidCertificate(certificate)) =
            error.downcast_ref::<rustls::Error>()
        {
            return Some(CertificateFailure::of(certificate));
        }
        if let Some(inner) = error
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::get_ref)
        {
            if let Some(found) = certificate_failure(inner) {
                return Some(found);
            }
        }
        next = error.source();
    }
    None
}

/// `error` and every cause under it, `: `-separated, each said once (clients often wrap an
/// error in one that repeats its text).
pub fn error_chain(error: &(dyn Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut last = text.clone();
    let mut next = error.source();
    while let Some(cause) = next {
        let said = cause.to_string();
        if !last.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        last = said;
        next = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn a_certificate_refusal_is_found_inside_io_errors_and_named() {
        let io = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer),
        );
        let wrapped = Outer(io);
        assert_eq!(
            certificate_failure(&wrapped),
            Some(CertificateFailure::UnknownIssuer)
        );
        assert_eq!(
            error_chain(&wrapped),
            "outer: invalid peer certificate: UnknownIssuer"
        );
        let plain = Outer(std::io::Error::other("connection refused"));
        assert_eq!(certificate_failure(&plain), None);
        for (error, failure) in [
            (CertificateError::Expired, CertificateFailure::Expired),
            (
                CertificateError::NotValidForName,
                CertificateFailure::NameMismatch,
            ),
            (CertificateError::BadSignature, CertificateFailure::Invalid),
        ] {
            let error = rustls::Error::InvalidCertificate(error);
            assert_eq!(certificate_failure(&error), Some(failure));
        }
    }

    /// A CA of the test's own, and a server certificate for `localhost` it signed.
    struct Ca {
        certificate: rcgen::Certificate,
        key: rcgen::KeyPair,
    }

    impl Ca {
        /// A CA named `name`: two CAs of one name would pass for each other's issuer, and
        /// the check would fail on the signature rather than on the issuer.
        fn new(name: &str) -> Self {
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            params.distinguished_name.push(
                rcgen::DnType::CommonName,
                format!("netguard test CA {name}"),
            );
            let key = rcgen::KeyPair::generate().unwrap();
            let certificate = params.self_signed(&key).unwrap();
            Self { certificate, key }
        }

        fn server(&self) -> Arc<rustls::ServerConfig> {
            let params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
            let key = rcgen::KeyPair::generate().unwrap();
            let certificate = params
                .signed_by(&key, &self.certificate, &self.key)
                .unwrap();
            let key = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap();
            Arc::new(
                rustls::ServerConfig::builder()
                    .with_no_client_auth()
                    .with_single_cert(vec![certificate.der().clone()], key)
                    .unwrap(),
            )
        }
    }

    /// A TLS handshake between `client` and `server` in memory, to `localhost`: the client's
    /// error if it refused the server.
    fn handshake(
        client: ClientConfig,
        server: Arc<rustls::ServerConfig>,
    ) -> Result<(), rustls::Error> {
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let mut client = rustls::ClientConnection::new(Arc::new(client), name)?;
        let mut server = rustls::ServerConnection::new(server)?;
        let mut bytes = Vec::new();
        // A full handshake takes two round trips; each turn moves what each side wrote.
        for _ in 0..10 {
            if !client.is_handshaking() && !server.is_handshaking() {
                return Ok(());
            }
            bytes.clear();
            client.write_tls(&mut bytes).unwrap();
            server.read_tls(&mut bytes.as_slice()).unwrap();
            server.process_new_packets()?;
            bytes.clear();
            server.write_tls(&mut bytes).unwrap();
            client.read_tls(&mut bytes.as_slice()).unwrap();
            client.process_new_packets()?;
        }
        panic!("the handshake did not end");
    }

    #[test]
    fn a_loaded_ca_file_makes_a_client_that_trusts_its_servers_and_no_others() {
        let dir = std::env::temp_dir().join(format!("relay-tls-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (ours, theirs) = (Ca::new("ours"), Ca::new("theirs"));
        let file = dir.join("ca.pem");
        std::fs::write(&file, ours.certificate.pem()).unwrap();

        let trust = TrustRoots::load(Some(&file)).unwrap();
        assert_eq!(trust.ca_file(), Some(file.as_path()));
        let bundle = String::from_utf8(trust.bundle_pem().expect("a bundle")).unwrap();
        assert!(bundle.contains(ours.certificate.pem().trim()));
        handshake(trust.client_config(), ours.server()).expect("the CA file's server is trusted");

        let refused = handshake(trust.client_config(), theirs.server()).unwrap_err();
        assert_eq!(
            certificate_failure(&refused),
            Some(CertificateFailure::UnknownIssuer)
        );
        let platform = handshake(TrustRoots::platform().client_config(), ours.server());
        assert_eq!(
            certificate_failure(&platform.unwrap_err()),
            Some(CertificateFailure::UnknownIssuer),
            "without the CA file, its servers are not trusted"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_ca_file_must_hold_certificates() {
        let dir = std::env::temp_dir().join(format!("relay-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        assert!(matches!(
            TrustRoots::load(Some(&empty)),
            Err(TrustError::Empty { .. })
        ));
        assert!(matches!(
            TrustRoots::load(Some(&dir.join("missing.pem"))),
            Err(TrustError::Read { .. })
        ));
        let platform = TrustRoots::load(None).unwrap();
        assert_eq!(platform.ca_file(), None);
        assert_eq!(platform.bundle_pem(), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
