/* The sizes, offsets and enum values of rdma-core's verbs.h that verbs/hw/abi.rs mirrors: its
 * `layouts_match_verbs_h` test records what this prints. Run it against the headers of the
 * machine the verbs domain will run on (libibverbs-dev, or rdma-core's include/) and compare:
 *
 *   gcc -I/usr/include layout.c -o layout && ./layout
 */
#include <stdio.h>
#include <stddef.h>
#include <infiniband/verbs.h>
#define S(t) printf("size %s %zu\n", #t, sizeof(struct t))
#define O(t,f) printf("off %s.%s %zu\n", #t, #f, offsetof(struct t, f))
#define V(x) printf("val %s %ld\n", #x, (long)(x))
int main(void){
 S(ibv_context); O(ibv_context,ops); O(ibv_context,ops.poll_cq); O(ibv_context,ops.post_srq_recv); O(ibv_context,ops.post_send); O(ibv_context,ops.post_recv);
 S(ibv_qp); O(ibv_qp,context); O(ibv_qp,qp_num);
 S(ibv_cq); S(ibv_srq); O(ibv_srq,context); S(ibv_mr); O(ibv_mr,lkey); O(ibv_mr,rkey);
 S(ibv_sge); S(ibv_send_wr); O(ibv_send_wr,next); O(ibv_send_wr,sg_list); O(ibv_send_wr,num_sge); O(ibv_send_wr,opcode); O(ibv_send_wr,send_flags); O(ibv_send_wr,imm_data); O(ibv_send_wr,wr.rdma.remote_addr); O(ibv_send_wr,wr.rdma.rkey); O(ibv_send_wr,wr.ud.ah); O(ibv_send_wr,wr.ud.remote_qpn); O(ibv_send_wr,wr.ud.remote_qkey);
 S(ibv_recv_wr); O(ibv_recv_wr,num_sge);
 S(ibv_wc); O(ibv_wc,status); O(ibv_wc,opcode); O(ibv_wc,byte_len); O(ibv_wc,imm_data); O(ibv_wc,qp_num); O(ibv_wc,src_qp); O(ibv_wc,wc_flags);
 S(ibv_global_route); S(ibv_ah_attr); O(ibv_ah_attr,dlid); O(ibv_ah_attr,is_global); O(ibv_ah_attr,port_num);
 S(ibv_qp_init_attr); O(ibv_qp_init_attr,cap); O(ibv_qp_init_attr,qp_type); S(ibv_srq_init_attr);
 S(ibv_port_attr); O(ibv_port_attr,state); O(ibv_port_attr,active_mtu); O(ibv_port_attr,lid); O(ibv_port_attr,link_layer);
 S(ibv_qp_attr); O(ibv_qp_attr,qkey); O(ibv_qp_attr,rq_psn); O(ibv_qp_attr,sq_psn); O(ibv_qp_attr,dest_qp_num); O(ibv_qp_attr,qp_access_flags); O(ibv_qp_attr,cap); O(ibv_qp_attr,ah_attr); O(ibv_qp_attr,alt_ah_attr); O(ibv_qp_attr,pkey_index); O(ibv_qp_attr,max_rd_atomic); O(ibv_qp_attr,max_dest_rd_atomic); O(ibv_qp_attr,min_rnr_timer); O(ibv_qp_attr,port_num); O(ibv_qp_attr,timeout); O(ibv_qp_attr,retry_cnt); O(ibv_qp_attr,rnr_retry); O(ibv_qp_attr,rate_limit);
 V(IBV_QPT_RC); V(IBV_QPT_UD); V(IBV_QPS_RESET); V(IBV_QPS_INIT); V(IBV_QPS_RTR); V(IBV_QPS_RTS); V(IBV_QPS_ERR);
 V(IBV_MTU_256); V(IBV_MTU_4096); V(IBV_WR_RDMA_WRITE); V(IBV_WR_RDMA_WRITE_WITH_IMM); V(IBV_WR_SEND); V(IBV_SEND_SIGNALED);
 V(IBV_ACCESS_LOCAL_WRITE); V(IBV_ACCESS_REMOTE_WRITE); V(IBV_ACCESS_RELAXED_ORDERING);
 V(IBV_WC_SUCCESS); V(IBV_WC_LOC_LEN_ERR); V(IBV_WC_LOC_PROT_ERR); V(IBV_WC_WR_FLUSH_ERR); V(IBV_WC_REM_INV_REQ_ERR); V(IBV_WC_REM_ACCESS_ERR); V(IBV_WC_RETRY_EXC_ERR); V(IBV_WC_RNR_RETRY_EXC_ERR);
 V(IBV_WC_SEND); V(IBV_WC_RDMA_WRITE); V(IBV_WC_RECV); V(IBV_WC_RECV_RDMA_WITH_IMM); V(IBV_WC_WITH_IMM);
 V(IBV_QP_STATE); V(IBV_QP_ACCESS_FLAGS); V(IBV_QP_PKEY_INDEX); V(IBV_QP_PORT); V(IBV_QP_QKEY); V(IBV_QP_AV); V(IBV_QP_PATH_MTU); V(IBV_QP_TIMEOUT); V(IBV_QP_RETRY_CNT); V(IBV_QP_RNR_RETRY); V(IBV_QP_RQ_PSN); V(IBV_QP_MAX_QP_RD_ATOMIC); V(IBV_QP_MIN_RNR_TIMER); V(IBV_QP_SQ_PSN); V(IBV_QP_MAX_DEST_RD_ATOMIC); V(IBV_QP_DEST_QPN);
 V(IBV_PORT_ACTIVE); V(IBV_LINK_LAYER_ETHERNET);
 return 0; }
