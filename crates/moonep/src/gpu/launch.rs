//! `moonep-launch`: one process per GPU. Sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT` and keeps `NCCL_NVLS_ENABLE=0`; when one rank fails, every other rank is killed.

use std::path::Path;
use std::process::{Child, Command, ExitStatus};
use std::time::Duration;

/// Launcher failures.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("cannot spawn rank {rank} ({program}): {source}")]
    Spawn {
        rank: usize,
        program: String,
        source: std::io::Error,
    },
    #[error("rank {rank} failed with {status}; the other ranks were killed")]
    RankFailed { rank: usize, status: ExitStatus },
    #[error("cannot pick a free port: {0}")]
    Port(std::io::Error),
    #[error("waiting on rank {rank}: {source}")]
    Wait { rank: usize, source: std::io::Error },
}

/// A free loopback TCP port (bound then released).
pub fn free_port() -> Result<u16, LaunchError> {
    let l = std::net::TcpListener::bind(("127.0.0.1", 0)).map_err(LaunchError::Port)?;
    Ok(l.local_addr().map_err(LaunchError::Port)?.port())
}

/// Runs `program args` as `n` ranks and waits for all of them. `port` 0 picks a free port.
pub fn launch(n: usize, program: &Path, args: &[String], port: u16) -> Result<(), LaunchError> {
    launch_with_env(n, program, args, port, &[])
}

/// [`launch`] with extra environment variables for every rank.
pub fn launch_with_env(
    n: usize,
    program: &Path,
    args: &[String],
    port: u16,
    env: &[(&str, &str)],
) -> Result<(), LaunchError> {
    let port = if port == 0 { free_port()? } else { port };
    let mut children: Vec<Option<Child>> = Vec::with_capacity(n);
    for rank in 0..n {
        let child = Command::new(program)
            .args(args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("NCCL_NVLS_ENABLE", "0")
            .envs(env.iter().copied())
            .spawn();
        match child {
            Ok(c) => children.push(Some(c)),
            Err(source) => {
                kill_all(&mut children);
                return Err(LaunchError::Spawn {
                    rank,
                    program: program.display().to_string(),
                    source,
                });
            }
        }
    }
    let mut left = n;
    while left > 0 {
        for rank in 0..n {
            let Some(child) = children[rank].as_mut() else {
                continue;
            };
            match child.try_wait() {
                Ok(Some(status)) => {
                    children[rank] = None;
                    left -= 1;
                    if !status.success() {
                        kill_all(&mut children);
                        return Err(LaunchError::RankFailed { rank, status });
                    }
                }
                Ok(None) => {}
                Err(source) => {
                    kill_all(&mut children);
                    return Err(LaunchError::Wait { rank, source });
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn kill_all(children: &mut [Option<Child>]) {
    for c in children.iter_mut().flatten() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_see_their_environment() {
        let dir = tempfile::tempdir().unwrap();
        let script = format!(
            "test \"$NCCL_NVLS_ENABLE\" = 0 && echo \"$RANK $WORLD_SIZE $LOCAL_RANK $MASTER_PORT\" > {}/r$RANK",
            dir.path().display()
        );
        launch(3, Path::new("/bin/sh"), &["-c".into(), script], 0).unwrap();
        for r in 0..3 {
            let line = std::fs::read_to_string(dir.path().join(format!("r{r}"))).unwrap();
            let f: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(
                &f[..3],
                &[r.to_string().as_str(), "3", r.to_string().as_str()]
            );
            assert!(f[3].parse::<u16>().unwrap() > 0);
        }
    }

    #[test]
    fn one_failing_rank_kills_the_rest() {
        let start = std::time::Instant::now();
        let script = "if [ \"$RANK\" = 1 ]; then exit 3; else sleep 30; fi".to_string();
        let err = launch(3, Path::new("/bin/sh"), &["-c".into(), script], 0).unwrap_err();
        assert!(
            matches!(err, LaunchError::RankFailed { rank: 1, .. }),
            "{err}"
        );
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "survivors were not killed"
        );
    }
}
