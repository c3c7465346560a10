//! The head-dim gate: 128 and 64 (verified on a GPU, 2026-12-05) run with no opt-in; any other head
//! dim is refused with a typed invalid-argument error.

use flashkda::head_dim::{VERIFIED_HEAD_DIMS, check_head_dim_enabled};
use flashkda::{FlashKdaError, head_dim_enabled};

#[test]
fn head_dims_128_and_64_run_others_are_refused() {
    assert_eq!(VERIFIED_HEAD_DIMS, [128, 64]);
    for d in [128, 64] {
        assert!(head_dim_enabled(d));
        assert!(check_head_dim_enabled(d).is_ok());
    }
    for d in [96, 32, 256] {
        assert!(!head_dim_enabled(d));
        let e = check_head_dim_enabled(d).unwrap_err();
        assert!(
            matches!(e, FlashKdaError::HeadDimUnverified(x) if x == d),
            "{e}"
        );
        assert!(e.is_invalid_argument());
    }
}
