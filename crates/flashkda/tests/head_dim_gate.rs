//! The head-dim-64 gate (its own process: the opt-in is process-wide). Without
//! FLASHKDA_EXPERIMENTAL_HEAD_DIM_64=1 in the environment, head dim 64 is refused with a typed error
//! naming the opt-in until `allow_unverified_head_dim_64` is called; 128 always runs.

use flashkda::head_dim::check_head_dim_enabled;
use flashkda::{FlashKdaError, HEAD_DIM_64_OPT_IN, allow_unverified_head_dim_64, head_dim_enabled};

#[test]
fn head_dim_64_is_refused_until_opted_in() {
    assert!(head_dim_enabled(128));
    assert!(check_head_dim_enabled(128).is_ok());
    assert!(!head_dim_enabled(96));
    let env_opted_in = std::env::var(HEAD_DIM_64_OPT_IN).is_ok_and(|v| v == "1");
    if !env_opted_in {
        assert!(!head_dim_enabled(64));
        let e = check_head_dim_enabled(64).unwrap_err();
        assert!(matches!(e, FlashKdaError::HeadDimUnverified(64)), "{e}");
        let msg = e.to_string();
        assert!(msg.contains("not yet verified on a GPU"), "{msg}");
        assert!(msg.contains(HEAD_DIM_64_OPT_IN), "{msg}");
        assert!(e.is_invalid_argument());
    }
    allow_unverified_head_dim_64();
    assert!(head_dim_enabled(64));
    assert!(check_head_dim_enabled(64).is_ok());
    assert!(!head_dim_enabled(96));
}
