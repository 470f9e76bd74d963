//! Unit tests of `hw`.

use super::*;
use std::mem::{offset_of, size_of};

/// Sizes and offsets printed by `layout.c` against rdma-core's verbs.h (x86-64 Linux):
/// the Rust mirrors must match them exactly.
#[test]
fn layouts_match_verbs_h() {
    assert_eq!(size_of::<IbvSge>(), 16);
    assert_eq!(size_of::<IbvSendWr>(), 128);
    assert_eq!(offset_of!(IbvSendWr, next), 8);
    assert_eq!(offset_of!(IbvSendWr, sg_list), 16);
    assert_eq!(offset_of!(IbvSendWr, num_sge), 24);
    assert_eq!(offset_of!(IbvSendWr, opcode), 28);
    assert_eq!(offset_of!(IbvSendWr, send_flags), 32);
    assert_eq!(offset_of!(IbvSendWr, imm_data), 36);
    assert_eq!(offset_of!(IbvSendWr, wr), 40);
    assert_eq!(offset_of!(Rdma, rkey), 8);
    assert_eq!(offset_of!(Ud, remote_qpn), 8);
    assert_eq!(offset_of!(Ud, remote_qkey), 12);
    assert_eq!(size_of::<IbvRecvWr>(), 32);
    assert_eq!(offset_of!(IbvRecvWr, num_sge), 24);
    assert_eq!(size_of::<IbvWc>(), 48);
    assert_eq!(offset_of!(IbvWc, status), 8);
    assert_eq!(offset_of!(IbvWc, opcode), 12);
    assert_eq!(offset_of!(IbvWc, byte_len), 20);
    assert_eq!(offset_of!(IbvWc, imm_data), 24);
    assert_eq!(offset_of!(IbvWc, qp_num), 28);
    assert_eq!(offset_of!(IbvWc, src_qp), 32);
    assert_eq!(offset_of!(IbvWc, wc_flags), 36);
    assert_eq!(size_of::<IbvGlobalRoute>(), 24);
    assert_eq!(std::mem::align_of::<IbvQpAttr>(), 8);
    assert_eq!(size_of::<IbvAhAttr>(), 32);
    assert_eq!(offset_of!(IbvAhAttr, dlid), 24);
    assert_eq!(offset_of!(IbvAhAttr, is_global), 29);
    assert_eq!(offset_of!(IbvAhAttr, port_num), 30);
    assert_eq!(size_of::<IbvQpInitAttr>(), 64);
    assert_eq!(offset_of!(IbvQpInitAttr, cap), 32);
    assert_eq!(offset_of!(IbvQpInitAttr, qp_type), 52);
    assert_eq!(size_of::<IbvSrqInitAttr>(), 24);
    assert_eq!(size_of::<IbvPortAttr>(), 56);
    assert_eq!(offset_of!(IbvPortAttr, active_mtu), 8);
    assert_eq!(offset_of!(IbvPortAttr, lid), 34);
    assert_eq!(offset_of!(IbvPortAttr, link_layer), 46);
    assert_eq!(size_of::<IbvQpAttr>(), 144);
    assert_eq!(offset_of!(IbvQpAttr, qkey), 16);
    assert_eq!(offset_of!(IbvQpAttr, rq_psn), 20);
    assert_eq!(offset_of!(IbvQpAttr, sq_psn), 24);
    assert_eq!(offset_of!(IbvQpAttr, dest_qp_num), 28);
    assert_eq!(offset_of!(IbvQpAttr, qp_access_flags), 32);
    assert_eq!(offset_of!(IbvQpAttr, cap), 36);
    assert_eq!(offset_of!(IbvQpAttr, ah_attr), 56);
    assert_eq!(offset_of!(IbvQpAttr, alt_ah_attr), 88);
    assert_eq!(offset_of!(IbvQpAttr, pkey_index), 120);
    assert_eq!(offset_of!(IbvQpAttr, max_rd_atomic), 126);
    assert_eq!(offset_of!(IbvQpAttr, max_dest_rd_atomic), 127);
    assert_eq!(offset_of!(IbvQpAttr, min_rnr_timer), 128);
    assert_eq!(offset_of!(IbvQpAttr, port_num), 129);
    assert_eq!(offset_of!(IbvQpAttr, timeout), 130);
    assert_eq!(offset_of!(IbvQpAttr, retry_cnt), 131);
    assert_eq!(offset_of!(IbvQpAttr, rnr_retry), 132);
    assert_eq!(offset_of!(IbvQpAttr, rate_limit), 136);
}

#[test]
fn opening_without_a_device_names_what_is_missing() {
    match HwVerbs::open(&VerbsConfig::default()) {
        Err(TransportError::ProviderUnavailable(why)) => {
            assert!(
                why.contains("libibverbs") || why.contains("no RDMA device"),
                "{why}"
            );
        }
        // A machine with an RDMA NIC opens it.
        Ok(v) => assert_eq!(v.port_addr().port, 1),
        Err(other) => panic!("{other:?}"),
    }
}
