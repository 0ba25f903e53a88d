//! The ext_proc port: listener (SO_REUSEPORT for workers), TLS with certificate reload, the
//! standard gRPC health service beside ext_proc, all on one tokio thread.

use std::net::{SocketAddr, ToSocketAddrs};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;
use tokio_rustls::rustls::{self, ServerConfig};
use tokio_rustls::TlsAcceptor;
use tokio_stream::wrappers::ReceiverStream;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use crate::bridge::Bridge;
use crate::events::{Event, Log};
use crate::stream::{Service, Settings};

const WARNING: u8 = 30;
/// A client that has not finished its TLS handshake by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const INFO: u8 = 20;

/// Where the TLS certificate comes from.
pub enum Tls {
    /// Made at start (PEM key, PEM chain).
    Fixed(Vec<u8>, Vec<u8>),
    /// tls.crt and tls.key in a directory (a mounted Secret), reloaded when either changes.
    Directory(PathBuf),
}

pub struct ServeOptions {
    pub address: String,
    pub reuse_port: bool,
    pub max_receive_bytes: usize,
    pub tls: Option<Tls>,
    /// Service names the health service reports (none: no health service on this port).
    pub health_services: Vec<String>,
    pub settings: Settings,
}

fn certified_key(key_pem: &[u8], cert_pem: &[u8]) -> Result<Arc<CertifiedKey>, String> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("certificate: {e}"))?;
    if certs.is_empty() {
        return Err("certificate: no PEM certificate found".into());
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| format!("private key: {e}"))?;
    let signing = rustls::crypto::ring::sign::any_supported_type(&key).map_err(|e| format!("private key: {e}"))?;
    Ok(Arc::new(CertifiedKey::new(certs, signing)))
}

type Stamp = (i64, i64, u64, u64);

/// The directory's certificate, re-read at a handshake when tls.crt or tls.key changed.
struct CertificateDirectory {
    crt: PathBuf,
    key: PathBuf,
    current: Mutex<(Stamp, Arc<CertifiedKey>)>,
    bridge: Arc<Bridge>,
}

impl std::fmt::Debug for CertificateDirectory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertificateDirectory").field("crt", &self.crt).finish()
    }
}

impl CertificateDirectory {
    fn open(path: PathBuf, bridge: Arc<Bridge>) -> Result<Self, String> {
        let (crt, key) = (path.join("tls.crt"), path.join("tls.key"));
        let stamp = Self::stamp(&crt, &key).map_err(|e| format!("{}: {e}", path.display()))?;
        let loaded = Self::load(&crt, &key)?;
        Ok(Self {
            crt,
            key,
            current: Mutex::new((stamp, loaded)),
            bridge,
        })
    }

    fn stamp(crt: &PathBuf, key: &PathBuf) -> std::io::Result<Stamp> {
        let (c, k) = (std::fs::metadata(crt)?, std::fs::metadata(key)?);
        Ok((
            c.mtime_nsec() + c.mtime() * 1_000_000_000,
            k.mtime_nsec() + k.mtime() * 1_000_000_000,
            c.ino(),
            k.ino(),
        ))
    }

    fn load(crt: &PathBuf, key: &PathBuf) -> Result<Arc<CertifiedKey>, String> {
        let key_pem = std::fs::read(key).map_err(|e| format!("{}: {e}", key.display()))?;
        let cert_pem = std::fs::read(crt).map_err(|e| format!("{}: {e}", crt.display()))?;
        certified_key(&key_pem, &cert_pem)
    }

    fn refreshed(&self) -> Arc<CertifiedKey> {
        let mut current = self.current.lock().unwrap();
        let changed = Self::stamp(&self.crt, &self.key).map(|stamp| (stamp != current.0).then_some(stamp));
        let stamp = match changed {
            Ok(None) => return current.1.clone(),
            Ok(Some(stamp)) => stamp,
            Err(e) => {
                self.log(WARNING, format!("keeping the current certificate: {e}"));
                return current.1.clone();
            }
        };
        match Self::load(&self.crt, &self.key) {
            Ok(loaded) => {
                *current = (stamp, loaded);
                self.log(
                    INFO,
                    format!(
                        "reloaded the TLS certificate from {}",
                        self.crt.parent().unwrap().display()
                    ),
                );
            }
            Err(e) => self.log(WARNING, format!("keeping the current certificate: {e}")),
        }
        current.1.clone()
    }

    fn log(&self, level: u8, message: String) {
        self.bridge.push(Event::Log(Log { level, message }));
    }
}

impl ResolvesServerCert for CertificateDirectory {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.refreshed())
    }
}

#[derive(Debug)]
struct FixedCertificate(Arc<CertifiedKey>);

impl ResolvesServerCert for FixedCertificate {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

fn tls_acceptor(tls: Tls, bridge: &Arc<Bridge>) -> Result<TlsAcceptor, String> {
    let resolver: Arc<dyn ResolvesServerCert> = match tls {
        Tls::Fixed(key, cert) => Arc::new(FixedCertificate(certified_key(&key, &cert)?)),
        Tls::Directory(path) => Arc::new(CertificateDirectory::open(path, bridge.clone())?),
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

fn bind(address: &str, reuse_port: bool) -> std::io::Result<std::net::TcpListener> {
    let addr: SocketAddr = address
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("cannot resolve {address}")))?;
    let socket = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(reuse_port)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

/// A running server: its port, its thread, and the handles to drain and stop it.
pub struct Running {
    pub port: u16,
    thread: Option<std::thread::JoinHandle<()>>,
    stop: Option<oneshot::Sender<Duration>>,
    health: Option<(HealthReporter, Vec<String>)>,
    handle: tokio::runtime::Handle,
}

impl Running {
    /// Report NOT_SERVING on the health service (a graceful shutdown begins).
    pub fn not_serving(&self) {
        if let Some((reporter, services)) = &self.health {
            let (reporter, services) = (reporter.clone(), services.clone());
            self.handle.spawn(async move {
                for service in services {
                    reporter.set_service_status(service, ServingStatus::NotServing).await;
                }
            });
        }
    }

    /// Stop accepting, let open streams end for at most `grace`, then close everything.
    pub fn stop(&mut self, grace: Duration) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(grace);
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop(Duration::ZERO);
    }
}

pub fn serve(options: ServeOptions, bridge: Arc<Bridge>) -> Result<Running, String> {
    let listener = bind(&options.address, options.reuse_port).map_err(|e| format!("{}: {e}", options.address))?;
    let port = listener.local_addr().map_err(|e| e.to_string())?.port();
    let acceptor = options.tls.map(|tls| tls_acceptor(tls, &bridge)).transpose()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let handle = runtime.handle().clone();
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    let with_health = !options.health_services.is_empty();
    let services = options.health_services.clone();
    {
        let reporter = health_reporter.clone();
        runtime.block_on(async move {
            for service in services {
                reporter.set_service_status(service, ServingStatus::Serving).await;
            }
        });
    }
    let processor = ExternalProcessorServer::new(Service {
        bridge,
        settings: options.settings,
    })
    .max_decoding_message_size(options.max_receive_bytes);
    let (stop_tx, stop_rx) = oneshot::channel::<Duration>();
    let thread = std::thread::Builder::new()
        .name("picker-extproc".into())
        .spawn(move || {
            runtime.block_on(async move {
                let listener = TcpListener::from_std(listener).expect("listener registers with tokio");
                let incoming = accept(listener, acceptor);
                let (grace_tx, grace_rx) = oneshot::channel::<Duration>();
                let shutdown = async move {
                    if let Ok(grace) = stop_rx.await {
                        let _ = grace_tx.send(grace);
                    }
                };
                let router = tonic::transport::Server::builder()
                    .add_optional_service(with_health.then_some(health_service))
                    .add_service(processor);
                let server = router.serve_with_incoming_shutdown(incoming, shutdown);
                tokio::pin!(server);
                tokio::select! {
                    _ = &mut server => {}
                    _ = async {
                        match grace_rx.await {
                            Ok(grace) => tokio::time::sleep(grace).await,
                            Err(_) => std::future::pending().await,
                        }
                    } => {}
                }
            });
            runtime.shutdown_background();
        })
        .map_err(|e| e.to_string())?;
    Ok(Running {
        port,
        thread: Some(thread),
        stop: Some(stop_tx),
        health: with_health.then_some((health_reporter, options.health_services)),
        handle,
    })
}

/// An Io that is either plain TCP or TLS over it.
type Connection = tokio_util_either::Either;

mod tokio_util_either {
    //! One connection type for both transports (tonic serves a single IO type).
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
    use tokio::net::TcpStream;
    use tokio_rustls::server::TlsStream;
    use tonic::transport::server::{Connected, TcpConnectInfo};

    pub enum Either {
        Plain(TcpStream),
        Tls(Box<TlsStream<TcpStream>>),
    }

    impl Connected for Either {
        type ConnectInfo = TcpConnectInfo;
        fn connect_info(&self) -> TcpConnectInfo {
            match self {
                Either::Plain(s) => s.connect_info(),
                Either::Tls(s) => s.get_ref().0.connect_info(),
            }
        }
    }

    impl AsyncRead for Either {
        fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
            match self.get_mut() {
                Either::Plain(s) => Pin::new(s).poll_read(cx, buf),
                Either::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            }
        }
    }

    impl AsyncWrite for Either {
        fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
            match self.get_mut() {
                Either::Plain(s) => Pin::new(s).poll_write(cx, buf),
                Either::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            }
        }
        fn poll_write_vectored(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            bufs: &[std::io::IoSlice<'_>],
        ) -> Poll<std::io::Result<usize>> {
            match self.get_mut() {
                Either::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
                Either::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
            }
        }
        fn is_write_vectored(&self) -> bool {
            match self {
                Either::Plain(s) => s.is_write_vectored(),
                Either::Tls(s) => s.is_write_vectored(),
            }
        }
        fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            match self.get_mut() {
                Either::Plain(s) => Pin::new(s).poll_flush(cx),
                Either::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
            }
        }
        fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            match self.get_mut() {
                Either::Plain(s) => Pin::new(s).poll_shutdown(cx),
                Either::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            }
        }
    }
}

/// Accepted connections, TLS handshakes done off the accept loop (a slow client holds only itself).
fn accept(listener: TcpListener, acceptor: Option<TlsAcceptor>) -> ReceiverStream<std::io::Result<Connection>> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let stream: TcpStream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(_) => {
                    // e.g. EMFILE: back off instead of spinning
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let tx = tx.clone();
            match &acceptor {
                None => {
                    if tx.send(Ok(Connection::Plain(stream))).await.is_err() {
                        return;
                    }
                }
                Some(acceptor) => {
                    let acceptor = acceptor.clone();
                    tokio::spawn(async move {
                        if let Ok(Ok(tls)) = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                            let _ = tx.send(Ok(Connection::Tls(Box::new(tls)))).await;
                        }
                    });
                }
            }
        }
    });
    ReceiverStream::new(rx)
}
