//! Compiles `kernels/moonep.cu` (which includes one file per phase) ahead of time for sm_90a when nvcc is found (NVCC, CUDA_HOME, PATH
//! or /opt/cuda13/nvidia/cu13). Without nvcc the cubin is empty and GPU entry points return
//! `GpuError::NoKernels`.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("moonep.sm_90a.cubin");
    let built = k3_common::toolkit::find_nvcc().is_some_and(|found| {
        let nvcc = found.nvcc;
        let status = Command::new(&nvcc)
            .args(k3_common::toolkit::SM90A_FLAGS)
            .arg("-cubin")
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
