//! Argument validation (no GPU needed: validation never touches device memory).

mod validate_common;
use validate_common::t;

use flashkda::validate::check_cu_seqlens;
use flashkda::{DType, Device, FlashKdaError, FwdArgs, StateDType, validate};

fn args(b: usize, tt: usize, h: usize) -> FwdArgs {
    FwdArgs {
        scale: 0.088,
        ..validate_common::args(b, tt, h, h, 128)
    }
}

#[test]
fn accepts_fixed_and_varlen() {
    let p = validate(&args(2, 64, 4)).unwrap();
    assert_eq!(
        (p.batch, p.seq_len, p.heads, p.num_seqs, p.varlen),
        (2, 64, 4, 2, false)
    );
    let mut a = args(1, 64, 4);
    a.cu_seqlens = Some(t(DType::I64, &[4], 0x9000));
    a.initial_state = Some(t(DType::F32, &[3, 4, 128, 128], 0xa000));
    let p = validate(&a).unwrap();
    assert_eq!((p.num_seqs, p.state), (3, Some(StateDType::F32)));
}

#[test]
fn rejects_bad_arguments_with_typed_errors() {
    let mut a = args(1, 8, 2);
    a.k.dtype = DType::F32;
    assert!(matches!(
        validate(&a),
        Err(FlashKdaError::DType { tensor: "k", .. })
    ));

    let mut a = args(1, 8, 2);
    a.q = t(DType::BF16, &[1, 8, 2, 96], 0x1000); // head dims are 64 or 128
    assert!(matches!(
        validate(&a),
        Err(FlashKdaError::Shape { tensor: "q", .. })
    ));

    let mut a = args(1, 8, 2);
    a.v.strides = vec![8 * 2 * 128, 128, 8 * 128, 1]; // [B, H, T, D] memory viewed as [B, T, H, D]
    assert!(matches!(
        validate(&a),
        Err(FlashKdaError::NotContiguous { tensor: "v", .. })
    ));

    let mut a = args(1, 8, 2);
    a.g.ptr = 0x4002;
    assert!(matches!(
        validate(&a),
        Err(FlashKdaError::Misaligned { tensor: "g", .. })
    ));

    let mut a = args(1, 8, 2);
    a.out.device = Device::Other("cpu".into());
    assert!(matches!(
        validate(&a),
        Err(FlashKdaError::Device { tensor: "out", .. })
    ));

    let mut a = args(1, 8, 2);
    a.beta.device = Device::Cuda(1);
    assert!(matches!(
        validate(&a),
        Err(FlashKdaError::Device { tensor: "beta", .. })
    ));

    for lb in [-6.0, 0.0, 0.5, f32::NAN] {
        let mut a = args(1, 8, 2);
        a.lower_bound = lb;
        assert!(
            matches!(validate(&a), Err(FlashKdaError::LowerBound(_))),
            "lower_bound {lb}"
        );
    }

    let mut a = args(2, 8, 2);
    a.cu_seqlens = Some(t(DType::I64, &[3], 0x9000));
    assert!(matches!(validate(&a), Err(FlashKdaError::VarlenBatch(2))));

    let mut a = args(1, 8, 2);
    a.cu_seqlens = Some(t(DType::BF16, &[3], 0x9000));
    assert!(matches!(
        validate(&a),
        Err(FlashKdaError::DType {
            tensor: "cu_seqlens",
            ..
        })
    ));

    let mut a = args(1, 8, 2);
    a.initial_state = Some(t(DType::BF16, &[1, 2, 128, 128], 0xa000));
    a.final_state = Some(t(DType::F32, &[1, 2, 128, 128], 0xb000));
    assert!(matches!(
        validate(&a),
        Err(FlashKdaError::StateDTypeMismatch { .. })
    ));

    let mut a = args(1, 8, 2);
    a.final_state = Some(t(DType::F32, &[2, 2, 128, 128], 0xb000));
    assert!(matches!(
        validate(&a),
        Err(FlashKdaError::Shape {
            tensor: "final_state",
            ..
        })
    ));

    let mut a = args(1, 8, 2);
    a.dt_bias = t(DType::F32, &[2], 0x8000);
    assert!(matches!(
        validate(&a),
        Err(FlashKdaError::Shape {
            tensor: "dt_bias",
            ..
        })
    ));

    let mut a = args(1, 8, 2);
    a.k.ptr = 0;
    assert!(matches!(
        validate(&a),
        Err(FlashKdaError::NullPointer { tensor: "k" })
    ));
}

#[test]
fn cu_seqlens_contents() {
    assert!(check_cu_seqlens(&[0, 3, 3, 10], 10).is_ok());
    assert!(matches!(
        check_cu_seqlens(&[1, 3, 10], 10),
        Err(FlashKdaError::CuSeqlens(_))
    ));
    assert!(matches!(
        check_cu_seqlens(&[0, 5, 3, 10], 10),
        Err(FlashKdaError::CuSeqlens(_))
    ));
    assert!(matches!(
        check_cu_seqlens(&[0, 3, 9], 10),
        Err(FlashKdaError::CuSeqlens(_))
    ));
}

fn bwd_args(b: usize, tt: usize, h: usize) -> flashkda::BwdArgs {
    validate_common::bwd_args(args(b, tt, h))
}

#[test]
fn bwd_validation_checks_every_gradient() {
    use flashkda::validate_bwd;
    let p = validate_bwd(&bwd_args(2, 64, 4)).unwrap();
    assert_eq!(
        (p.fwd.num_seqs, p.fwd.state, p.dinitial_state),
        (2, None, None)
    );
    let mut a = bwd_args(1, 64, 4);
    a.cu_seqlens = Some(t(DType::I64, &[4], 0x9000));
    a.dfinal_state = Some(t(DType::F32, &[3, 4, 128, 128], 0xa000));
    a.dinitial_state = Some(t(DType::BF16, &[3, 4, 128, 128], 0xb000));
    let p = validate_bwd(&a).unwrap();
    assert_eq!(
        (p.fwd.num_seqs, p.fwd.state, p.dinitial_state),
        (3, Some(StateDType::F32), Some(StateDType::BF16))
    );
    // a forward-input error is the forward's
    let mut a = bwd_args(1, 8, 2);
    a.lower_bound = 0.5;
    assert!(matches!(
        validate_bwd(&a),
        Err(FlashKdaError::LowerBound(_))
    ));
    // each gradient by name
    let mut a = bwd_args(1, 8, 2);
    a.dout.dtype = DType::F32;
    assert!(matches!(
        validate_bwd(&a),
        Err(FlashKdaError::DType { tensor: "dout", .. })
    ));
    let mut a = bwd_args(1, 8, 2);
    a.dk = t(DType::BF16, &[1, 8, 2, 64], 0x13000);
    assert!(matches!(
        validate_bwd(&a),
        Err(FlashKdaError::Shape { tensor: "dk", .. })
    ));
    let mut a = bwd_args(1, 8, 2);
    a.dbeta.ptr = 0x16001;
    assert!(matches!(
        validate_bwd(&a),
        Err(FlashKdaError::Misaligned {
            tensor: "dbeta",
            ..
        })
    ));
    let mut a = bwd_args(1, 8, 2);
    a.ddt_bias.device = Device::Other("cpu".into());
    assert!(matches!(
        validate_bwd(&a),
        Err(FlashKdaError::Device {
            tensor: "ddt_bias",
            ..
        })
    ));
    // the upstream state gradient must match the initial state's dtype
    let mut a = bwd_args(1, 8, 2);
    a.initial_state = Some(t(DType::BF16, &[1, 2, 128, 128], 0xa000));
    a.dfinal_state = Some(t(DType::F32, &[1, 2, 128, 128], 0xc000));
    assert!(matches!(
        validate_bwd(&a),
        Err(FlashKdaError::StateDTypeMismatch { .. })
    ));
    let mut a = bwd_args(1, 8, 2);
    a.dinitial_state = Some(t(DType::I64, &[1, 2, 128, 128], 0xb000));
    assert!(matches!(
        validate_bwd(&a),
        Err(FlashKdaError::DType {
            tensor: "dinitial_state",
            ..
        })
    ));
}
