//! Loopback TCP key/value store: rank 0 serves, every rank (rank 0 included) is a client.
//! Gives the NCCL unique-id exchange, host barriers and small all-gathers. Keys are write-once;
//! `get` blocks until the key exists or the timeout passes.
//!
//! Wire format (both directions little-endian): request `op:u8, klen:u32, key, vlen:u32, value`;
//! reply `status:u8, vlen:u32, value` (status 0 = ok, 1 = timeout).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;

/// Store failures.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot bind the store on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot reach the store at {addr} within {secs} s: {source}")]
    Connect {
        addr: SocketAddr,
        secs: u64,
        source: std::io::Error,
    },
    #[error("store i/o on key `{key}`: {source}")]
    Io { key: String, source: std::io::Error },
    #[error("timed out after {secs} s waiting for key `{key}`")]
    Timeout { key: String, secs: u64 },
}

type Map = Arc<(Mutex<HashMap<String, Vec<u8>>>, Condvar)>;

/// The serving side (rank 0 keeps it alive for the whole run).
pub struct StoreServer {
    pub addr: SocketAddr,
}

impl StoreServer {
    /// Binds `127.0.0.1:port` (0 = any free port) and serves on background threads.
    pub fn start(port: u16) -> Result<StoreServer, StoreError> {
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let listener =
            TcpListener::bind(addr).map_err(|source| StoreError::Bind { addr, source })?;
        let addr = listener
            .local_addr()
            .map_err(|source| StoreError::Bind { addr, source })?;
        let map: Map = Arc::new((Mutex::new(HashMap::new()), Condvar::new()));
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let map = map.clone();
                std::thread::spawn(move || serve_conn(conn, map));
            }
        });
        Ok(StoreServer { addr })
    }
}

fn read_frame(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let mut v = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut v)?;
    Ok(v)
}

fn write_frame(s: &mut TcpStream, v: &[u8]) -> std::io::Result<()> {
    s.write_all(&(v.len() as u32).to_le_bytes())?;
    s.write_all(v)
}

fn serve_conn(mut conn: TcpStream, map: Map) {
    let _ = conn.set_nodelay(true);
    loop {
        let mut op = [0u8; 1];
        if conn.read_exact(&mut op).is_err() {
            return;
        }
        let Ok(key) = read_frame(&mut conn) else {
            return;
        };
        let Ok(value) = read_frame(&mut conn) else {
            return;
        };
        let key = String::from_utf8_lossy(&key).into_owned();
        let (lock, cv) = &*map;
        let reply = match op[0] {
            OP_SET => {
                lock.lock().expect("store map").insert(key, value);
                cv.notify_all();
                (0u8, Vec::new())
            }
            _ => {
                let timeout = Duration::from_millis(u64::from_le_bytes(
                    value[..8].try_into().unwrap_or([0; 8]),
                ));
                let deadline = Instant::now() + timeout;
                let mut m = lock.lock().expect("store map");
                loop {
                    if let Some(v) = m.get(&key) {
                        break (0u8, v.clone());
                    }
                    let now = Instant::now();
                    if now >= deadline {
                        break (1u8, Vec::new());
                    }
                    m = cv.wait_timeout(m, deadline - now).expect("store map").0;
                }
            }
        };
        if conn.write_all(&[reply.0]).is_err() || write_frame(&mut conn, &reply.1).is_err() {
            return;
        }
    }
}

/// A client connection; also numbers barriers and all-gathers so every rank uses the same keys.
pub struct StoreClient {
    conn: TcpStream,
    rank: usize,
    world: usize,
    seq: u64,
    pub timeout: Duration,
}

impl StoreClient {
    /// Connects to `addr`, retrying for up to `wait`.
    pub fn connect(
        addr: SocketAddr,
        rank: usize,
        world: usize,
        wait: Duration,
    ) -> Result<StoreClient, StoreError> {
        let start = Instant::now();
        loop {
            match TcpStream::connect(addr) {
                Ok(conn) => {
                    let _ = conn.set_nodelay(true);
                    return Ok(StoreClient {
                        conn,
                        rank,
                        world,
                        seq: 0,
                        timeout: Duration::from_secs(300),
                    });
                }
                Err(source) if start.elapsed() >= wait => {
                    return Err(StoreError::Connect {
                        addr,
                        secs: wait.as_secs(),
                        source,
                    });
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    fn request(&mut self, op: u8, key: &str, value: &[u8]) -> Result<(u8, Vec<u8>), StoreError> {
        let io = |source| StoreError::Io {
            key: key.to_string(),
            source,
        };
        self.conn.write_all(&[op]).map_err(io)?;
        write_frame(&mut self.conn, key.as_bytes()).map_err(io)?;
        write_frame(&mut self.conn, value).map_err(io)?;
        let mut st = [0u8; 1];
        self.conn.read_exact(&mut st).map_err(io)?;
        let v = read_frame(&mut self.conn).map_err(io)?;
        Ok((st[0], v))
    }

    /// Sets `key` (write-once by convention).
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.request(OP_SET, key, value).map(|_| ())
    }

    /// Blocks until `key` exists and returns its value.
    pub fn get(&mut self, key: &str) -> Result<Vec<u8>, StoreError> {
        let ms = self.timeout.as_millis() as u64;
        match self.request(OP_GET, key, &ms.to_le_bytes())? {
            (0, v) => Ok(v),
            _ => Err(StoreError::Timeout {
                key: key.to_string(),
                secs: self.timeout.as_secs(),
            }),
        }
    }

    /// Every rank contributes `mine`; returns all contributions in rank order.
    pub fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, StoreError> {
        self.seq += 1;
        let seq = self.seq;
        self.set(&format!("ag/{seq}/{}", self.rank), mine)?;
        (0..self.world)
            .map(|r| self.get(&format!("ag/{seq}/{r}")))
            .collect()
    }

    /// Host barrier over all ranks.
    pub fn barrier(&mut self) -> Result<(), StoreError> {
        self.all_gather(&[]).map(|_| ())
    }

    /// Rank 0's `value` delivered to everyone.
    pub fn broadcast0(&mut self, value: &[u8]) -> Result<Vec<u8>, StoreError> {
        self.seq += 1;
        let key = format!("bc/{}", self.seq);
        if self.rank == 0 {
            self.set(&key, value)?;
        }
        self.get(&key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_gather_barrier_and_broadcast_across_threads() {
        let server = StoreServer::start(0).unwrap();
        let world = 4;
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let addr = server.addr;
                std::thread::spawn(move || {
                    let mut c =
                        StoreClient::connect(addr, rank, world, Duration::from_secs(5)).unwrap();
                    let got = c.all_gather(&[rank as u8; 3]).unwrap();
                    c.barrier().unwrap();
                    let b = c.broadcast0(if rank == 0 { b"id-0" } else { b"" }).unwrap();
                    (got, b)
                })
            })
            .collect();
        for h in handles {
            let (got, b) = h.join().unwrap();
            assert_eq!(
                got,
                (0..world).map(|r| vec![r as u8; 3]).collect::<Vec<_>>()
            );
            assert_eq!(b, b"id-0");
        }
    }

    #[test]
    fn get_times_out_on_missing_key() {
        let server = StoreServer::start(0).unwrap();
        let mut c = StoreClient::connect(server.addr, 0, 1, Duration::from_secs(5)).unwrap();
        c.timeout = Duration::from_millis(50);
        assert!(matches!(c.get("never"), Err(StoreError::Timeout { .. })));
    }
}
