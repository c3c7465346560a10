//! Finding the CUDA toolkit's `nvcc` without a system CUDA install (usable from build scripts).

use std::path::{Path, PathBuf};

/// Where `nvcc` was found and the toolkit root beside it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nvcc {
    pub nvcc: PathBuf,
    pub cuda_home: PathBuf,
}

/// Looks for nvcc in `$NVCC`, `$CUDA_HOME/bin`, `PATH`, then the pip `cuda-toolkit` layouts
/// (`/opt/cuda13/nvidia/cu13`, and `nvidia/cu13` under this Python's site-packages if given in `$K3_CUDA_PIP_DIR`).
pub fn find_nvcc() -> Option<Nvcc> {
    let from_bin = |nvcc: PathBuf| {
        let home = nvcc.parent()?.parent()?.to_path_buf();
        nvcc.is_file().then_some(Nvcc {
            nvcc,
            cuda_home: home,
        })
    };
    if let Some(p) = std::env::var_os("NVCC").map(PathBuf::from)
        && let Some(n) = from_bin(p)
    {
        return Some(n);
    }
    if let Some(home) = std::env::var_os("CUDA_HOME").map(PathBuf::from)
        && let Some(n) = from_bin(home.join("bin").join("nvcc"))
    {
        return Some(n);
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            if let Some(n) = from_bin(dir.join("nvcc")) {
                return Some(n);
            }
        }
    }
    let mut pip_dirs = vec![PathBuf::from("/opt/cuda13")];
    if let Some(d) = std::env::var_os("K3_CUDA_PIP_DIR") {
        pip_dirs.insert(0, PathBuf::from(d));
    }
    pip_dirs
        .into_iter()
        .find_map(|d| from_bin(Path::new(&d).join("nvidia/cu13/bin/nvcc")))
}

/// The nvcc flags every sm_90a kernel is built with (`-arch=sm_90a` would also run a compute_90 pass that
/// rejects wgmma, so name the real target explicitly).
pub const SM90A_FLAGS: &[&str] = &[
    "-gencode=arch=compute_90a,code=sm_90a",
    "-O3",
    "-lineinfo",
    "-std=c++17",
];
