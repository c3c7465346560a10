//! One rank's bootstrap: environment from the launcher, device, store, and an NCCL communicator
//! when every rank has its own GPU. Ranks sharing a GPU (the single-GPU test mode: NCCL refuses
//! two ranks on one device) get none; the IPC path needs only the store.

use std::net::SocketAddr;
use std::time::Duration;

use super::GpuError;
use super::driver::{Device, device_count};
use super::nccl::{self, Comm};
use super::store::{StoreClient, StoreServer};

/// `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_PORT` as set by `moonep-launch` (or torchrun).
#[derive(Debug, Clone, Copy)]
pub struct RankEnv {
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
    pub port: u16,
}

impl RankEnv {
    /// Reads the launcher's variables.
    pub fn from_env() -> Result<RankEnv, GpuError> {
        fn var<T: std::str::FromStr>(k: &str) -> Result<T, GpuError> {
            std::env::var(k)
                .map_err(|_| GpuError::Env(format!("{k} is not set (run under moonep-launch)")))?
                .parse()
                .map_err(|_| GpuError::Env(format!("{k} is not a number")))
        }
        let env = RankEnv {
            rank: var("RANK")?,
            world: var("WORLD_SIZE")?,
            local_rank: var("LOCAL_RANK")?,
            port: var("MASTER_PORT")?,
        };
        if std::env::var("NCCL_NVLS_ENABLE").as_deref() != Ok("0") {
            return Err(GpuError::Env(
                "NCCL_NVLS_ENABLE must be 0 (NVLink multicast is forbidden)".into(),
            ));
        }
        Ok(env)
    }
}

/// A bootstrapped rank: device (context current), store client, NCCL communicator.
pub struct Rank {
    pub env: RankEnv,
    pub dev: Device,
    pub store: StoreClient,
    comm: Option<Comm>,
    _server: Option<StoreServer>,
}

impl Rank {
    /// Opens device `MOONEP_DEVICE` or `LOCAL_RANK % devices`, starts/joins the store and, when no two ranks share
    /// a device, exchanges the NCCL id and inits NCCL.
    pub fn init(env: RankEnv) -> Result<Rank, GpuError> {
        let n_devices = device_count()?;
        if n_devices == 0 {
            return Err(GpuError::Env("no CUDA device".into()));
        }
        // MOONEP_DEVICE pins every rank to one GPU (the two-ranks-on-one-GPU tests).
        let ordinal = match std::env::var("MOONEP_DEVICE") {
            Ok(v) => v
                .parse::<usize>()
                .map_err(|_| GpuError::Env(format!("MOONEP_DEVICE={v} is not a number")))?,
            Err(_) => env.local_rank % n_devices,
        };
        let dev = Device::open(ordinal)?;
        let server = if env.rank == 0 {
            Some(StoreServer::start(env.port)?)
        } else {
            None
        };
        let addr = SocketAddr::from(([127, 0, 0, 1], env.port));
        let mut store = StoreClient::connect(addr, env.rank, env.world, Duration::from_secs(60))?;
        let ordinals = store.all_gather(&(dev.ordinal as u32).to_le_bytes())?;
        let mut distinct = ordinals.clone();
        distinct.sort();
        distinct.dedup();
        let comm = if distinct.len() == ordinals.len() {
            let id = if env.rank == 0 {
                nccl::unique_id()?.to_vec()
            } else {
                Vec::new()
            };
            let id = store.broadcast0(&id)?;
            let id: [u8; 128] = id
                .try_into()
                .map_err(|_| GpuError::Env("NCCL id is not 128 bytes".into()))?;
            Some(Comm::init(&id, env.rank, env.world)?)
        } else {
            None
        };
        Ok(Rank {
            env,
            dev,
            store,
            comm,
            _server: server,
        })
    }

    /// The NCCL communicator (absent when ranks share a GPU).
    pub fn comm(&self) -> Result<&Comm, GpuError> {
        self.comm.as_ref().ok_or(GpuError::NoComm)
    }

    /// True when two ranks share a device (no NCCL; the IPC path only).
    pub fn shares_device(&self) -> bool {
        self.comm.is_none()
    }
}
