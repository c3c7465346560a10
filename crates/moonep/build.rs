//! Compiles `kernels/moonep.cu` ahead of time for sm_90a when nvcc is found (NVCC, CUDA_HOME, PATH
//! or /opt/cuda13/nvidia/cu13). Without nvcc the cubin is empty and GPU entry points return
//! `GpuError::NoKernels`.
use std::path::{Path, PathBuf};
use std::process::Command;

fn find_nvcc() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("NVCC") {
        return Some(PathBuf::from(p));
    }
    if let Ok(home) = std::env::var("CUDA_HOME") {
        let p = Path::new(&home).join("bin/nvcc");
        if p.exists() {
            return Some(p);
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("nvcc");
            if p.exists() {
                return Some(p);
            }
        }
    }
    let p = PathBuf::from("/opt/cuda13/nvidia/cu13/bin/nvcc");
    p.exists().then_some(p)
}

fn main() {
    println!("cargo:rerun-if-changed=kernels/moonep.cu");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("moonep.sm_90a.cubin");
    let built = find_nvcc().is_some_and(|nvcc| {
        let status = Command::new(&nvcc)
            .args([
                "-gencode=arch=compute_90a,code=sm_90a",
                "-cubin",
                "-O3",
                "-lineinfo",
            ])
            .arg("-o")
            .arg(&out)
            .arg("kernels/moonep.cu")
            .status();
        match status {
            Ok(s) if s.success() => true,
            Ok(s) => panic!("nvcc {} failed on kernels/moonep.cu: {s}", nvcc.display()),
            Err(e) => {
                println!(
                    "cargo:warning=nvcc {} not runnable ({e}); GPU kernels disabled",
                    nvcc.display()
                );
                false
            }
        }
    });
    if !built {
        println!("cargo:warning=nvcc not found; moonep GPU entry points will return NoKernels");
        std::fs::write(&out, []).expect("write empty cubin");
    }
}
