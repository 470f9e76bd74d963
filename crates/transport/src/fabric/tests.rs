//! The fabric domain's pure parts; the domain itself is tested over real providers in
//! `tests/fabric_*.rs`.

use super::*;

#[test]
fn provider_names_parse_to_choices_and_print_back() {
    for (s, c) in [
        ("auto", ProviderChoice::Auto),
        ("efa", ProviderChoice::Efa),
        ("tcp", ProviderChoice::Tcp),
        ("tcp;ofi_rxm", ProviderChoice::Tcp),
        ("shm", ProviderChoice::Shm),
        (
            "verbs;ofi_rxm",
            ProviderChoice::Named("verbs;ofi_rxm".to_owned()),
        ),
    ] {
        assert_eq!(s.parse::<ProviderChoice>().unwrap(), c);
    }
    assert_eq!(ProviderChoice::Tcp.to_string(), "tcp;ofi_rxm");
    assert_eq!(ProviderChoice::Auto.to_string(), "auto");
    assert!("".parse::<ProviderChoice>().is_err());
}

#[test]
fn bad_configs_are_typed_errors_before_libfabric_is_touched() {
    let bad = [
        FabricConfig {
            nics: 0,
            ..FabricConfig::default()
        },
        FabricConfig {
            nics: 5,
            ..FabricConfig::default()
        },
        FabricConfig {
            cq_batch: 0,
            ..FabricConfig::default()
        },
        FabricConfig {
            send_buffer_len: 0,
            ..FabricConfig::default()
        },
        FabricConfig {
            node: Some("127.0.0.1\0".to_owned()),
            ..FabricConfig::default()
        },
    ];
    for config in bad {
        assert!(
            matches!(open(&config), Err(TransportError::InvalidArgument(_))),
            "{config:?}"
        );
    }
}

#[test]
fn a_missing_required_provider_is_refused_not_replaced() {
    let config = FabricConfig {
        provider: ProviderChoice::Named("no-such-provider".to_owned()),
        required: true,
        ..FabricConfig::default()
    };
    match open(&config) {
        Err(TransportError::ProviderUnavailable(why)) => {
            assert!(
                why.contains("no-such-provider") && why.contains("not falling back"),
                "{why}"
            );
        }
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("a provider that does not exist opened"),
    }
}
