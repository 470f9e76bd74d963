//! Every kind of bad input named by the cost model's contract gets its typed error.

// Test helpers panic on failure: that is how a test reports it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvroute_costmodel::{
    Allowed, Congestion, CostModel, CostModelError, CostParams, Fabric, MergeCost, ModelDims,
    Request, Requirement, fabric_preset, model_preset,
};

fn params() -> CostParams {
    CostParams::paper_defaults(
        model_preset("deepseek-v2-lite").unwrap().dims,
        fabric_preset("h100-ibgda").unwrap().fabric,
    )
}

fn costs() -> CostModel {
    CostModel::new(params()).unwrap()
}

fn invalid(name: &'static str) -> impl Fn(&CostModelError) -> bool {
    move |e| matches!(e, CostModelError::InvalidParameter { name: n, .. } if *n == name)
}

#[test]
fn zero_counts_in_a_request_are_named() {
    let c = costs();
    let zero_mq = c.decide(&Request::contiguous(0, 2048)).unwrap_err();
    assert_eq!(
        zero_mq,
        CostModelError::InvalidParameter {
            name: "mq_rows",
            value: 0.0,
            requirement: Requirement::NonZeroCount
        }
    );
    assert!(invalid("chunk_tokens")(
        &c.decide(&Request::contiguous(1, 0)).unwrap_err()
    ));
    assert!(invalid("tp_degree")(
        &c.decide(&Request {
            tp_degree: 0,
            ..Request::contiguous(1, 1)
        })
        .unwrap_err()
    ));
    assert!(invalid("holders")(
        &c.decide(&Request::sparse(1, 4096, 2048, 0)).unwrap_err()
    ));
}

#[test]
fn a_selection_larger_than_its_chunk_or_thinner_than_its_holders_is_refused() {
    let c = costs();
    assert_eq!(
        c.decide(&Request::sparse(1, 1024, 2048, 1)).unwrap_err(),
        CostModelError::TopKExceedsChunk {
            topk: 2048,
            chunk_tokens: 1024
        }
    );
    assert_eq!(
        c.route(&Request::sparse(1, 4096, 4, 8)).unwrap_err(),
        CostModelError::MoreHoldersThanEntries {
            topk: 4,
            holders: 8
        }
    );
}

#[test]
fn forbidding_every_primitive_is_refused() {
    let none = Request {
        allowed: Allowed {
            route: false,
            fetch: false,
            local: false,
        },
        ..Request::contiguous(1, 1)
    };
    assert_eq!(
        costs().decide(&none).unwrap_err(),
        CostModelError::NoPrimitiveAllowed
    );
}

#[test]
fn non_finite_negative_and_zero_parameters_are_refused_at_construction() {
    let cases: [(CostParams, &str); 7] = [
        (
            CostParams {
                merge: MergeCost {
                    fixed_us: f64::NAN,
                    ..MergeCost::PAPER_BOUND
                },
                ..params()
            },
            "merge.fixed_us",
        ),
        (
            CostParams {
                merge: MergeCost {
                    us_per_row_part: -1.0,
                    ..MergeCost::PAPER_BOUND
                },
                ..params()
            },
            "merge.us_per_row_part",
        ),
        (
            CostParams {
                local_us_per_token_layer: 0.0,
                ..params()
            },
            "local_us_per_token_layer",
        ),
        (
            CostParams {
                fabric: Fabric {
                    bw_gbps: f64::INFINITY,
                    ..params().fabric
                },
                ..params()
            },
            "bw_gbps",
        ),
        (
            CostParams {
                fabric: Fabric {
                    probe_us: -16.0,
                    ..params().fabric
                },
                ..params()
            },
            "probe_us",
        ),
        (
            CostParams {
                model: ModelDims {
                    layers: 0,
                    ..params().model
                },
                ..params()
            },
            "layers",
        ),
        (
            CostParams {
                congestion: Congestion {
                    bw_degradation: 0.5,
                    ..Congestion::NONE
                },
                ..params()
            },
            "bw_degradation",
        ),
    ];
    for (p, name) in cases {
        let err = CostModel::new(p).unwrap_err();
        assert!(invalid(name)(&err), "{name}: {err}");
    }
}

#[test]
fn unknown_presets_are_typed_errors_that_list_the_known_ones() {
    let err = model_preset("gpt-7").unwrap_err();
    assert!(err.to_string().contains("deepseek-v3.2"), "{err}");
    let err = fabric_preset("carrier-pigeon").unwrap_err();
    assert!(err.to_string().contains("h100-ibgda"), "{err}");
}

#[test]
fn deserialised_parameters_are_only_trusted_after_construction() {
    // A file may hold anything; serde accepts the shape and CostModel::new judges the values.
    let mut json: serde_json::Value = serde_json::to_value(params()).unwrap();
    json["fabric"]["bw_gbps"] = serde_json::json!(-3.0);
    let p: CostParams = serde_json::from_value(json).unwrap();
    assert!(invalid("bw_gbps")(&CostModel::new(p).unwrap_err()));
}

#[test]
fn parameters_whose_cost_is_not_finite_are_refused() {
    // Each value is valid on its own; together they price a transfer at infinity.
    let fabric = Fabric::measured(1e308, 1e-308).unwrap();
    let costs = CostModel::new(CostParams { fabric, ..params() }).unwrap();
    let err = costs.decide(&Request::contiguous(256, 2048)).unwrap_err();
    assert!(
        matches!(err, CostModelError::NonFiniteCost { value, .. } if !value.is_finite()),
        "{err}"
    );
}
