/* Unreliable connected QPs through libibverbs: creation (classic and extended, with the send
 * operations UC has), ibv_query_qp, the UC state table (RC-only attributes refused with
 * EINVAL, the UC masks accepted), SEND with immediate, RDMA WRITE and WRITE with immediate
 * between rb0 and rb1 with the data checked, READ and atomics refused at post time with
 * bad_wr, and the ibv_wr_* builder on a UC QP. */
#include "common.h"

#define LEN 65536

static struct ibv_qp *uc_qp(struct side *s)
{
	struct ibv_qp_init_attr ia = {
		.send_cq = s->cq,
		.recv_cq = s->cq,
		.cap = {.max_send_wr = 32, .max_recv_wr = 32, .max_send_sge = 2,
			.max_recv_sge = 2, .max_inline_data = 64},
		.qp_type = IBV_QPT_UC,
		.sq_sig_all = 1,
	};
	struct ibv_qp *qp = ibv_create_qp(s->pd, &ia);
	CHECK(qp != NULL);
	CHECK_EQ(qp->qp_type, IBV_QPT_UC);
	CHECK_EQ(qp->state, IBV_QPS_RESET);
	s->qp = qp;
	return qp;
}

/* RESET -> INIT -> RTR -> RTS with the UC masks, as ibv_uc_pingpong does; the RC-only
 * attributes are refused at each step first. */
static void uc_connect(struct ibv_qp *qp, uint32_t dest_qpn, const union ibv_gid *dgid)
{
	struct ibv_qp_attr a = {
		.qp_state = IBV_QPS_INIT,
		.pkey_index = 0,
		.port_num = 1,
		.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE,
	};
	/* ACCESS_FLAGS is required from RESET. */
	CHECK_RET(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT),
		  EINVAL);
	CHECK_RET(ibv_modify_qp(qp, &a,
				IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
					IBV_QP_ACCESS_FLAGS),
		  0);
	struct qp_opts o = default_qp_opts();
	o.rq_psn = 0x77;
	a = rtr_attr(dest_qpn, dgid, &o);
	int base = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
	CHECK_RET(ibv_modify_qp(qp, &a, base | IBV_QP_MAX_DEST_RD_ATOMIC), EINVAL);
	CHECK_RET(ibv_modify_qp(qp, &a, base | IBV_QP_MIN_RNR_TIMER), EINVAL);
	CHECK_RET(ibv_modify_qp(qp, &a, base & ~IBV_QP_RQ_PSN), EINVAL);
	CHECK_EQ(qp->state, IBV_QPS_INIT);
	CHECK_RET(ibv_modify_qp(qp, &a, base), 0);
	struct ibv_qp_attr r = {.qp_state = IBV_QPS_RTS, .sq_psn = 0x77, .timeout = 14,
				.retry_cnt = 7, .rnr_retry = 7, .max_rd_atomic = 1};
	CHECK_RET(ibv_modify_qp(qp, &r, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT), EINVAL);
	CHECK_RET(ibv_modify_qp(qp, &r, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_RETRY_CNT),
		  EINVAL);
	CHECK_RET(ibv_modify_qp(qp, &r, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC),
		  EINVAL);
	CHECK_RET(ibv_modify_qp(qp, &r, IBV_QP_STATE), EINVAL);
	CHECK_RET(ibv_modify_qp(qp, &r, IBV_QP_STATE | IBV_QP_SQ_PSN), 0);
	CHECK_EQ(qp->state, IBV_QPS_RTS);
}

static void traffic(struct side *a, struct side *b)
{
	struct ibv_wc wc;
	/* A three-packet SEND with immediate (MTU 1024). */
	fill(a->buf, 3000, 7);
	post_recv(b->qp, 50, b->buf, 4096, b->mr->lkey);
	struct ibv_sge sge = {(uintptr_t)a->buf, 3000, a->mr->lkey};
	struct ibv_send_wr w = {.wr_id = 1, .sg_list = &sge, .num_sge = 1,
				.opcode = IBV_WR_SEND_WITH_IMM, .imm_data = htobe32(0x1234)};
	struct ibv_send_wr *bad = NULL;
	CHECK_RET(ibv_post_send(a->qp, &w, &bad), 0);
	EXPECT_WC(a->cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	CHECK_EQ(wc.wr_id, 1);
	EXPECT_WC(b->cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 50);
	CHECK_EQ(wc.byte_len, 3000);
	CHECK(wc.wc_flags & IBV_WC_WITH_IMM);
	CHECK_EQ(be32toh(wc.imm_data), 0x1234);
	CHECK_EQ(wc.qp_num, b->qp->qp_num);
	CHECK_MEM(b->buf, a->buf, 3000);

	/* RDMA WRITE, then WRITE with immediate, which takes a receive. */
	fill(a->buf + 4096, 5000, 9);
	post_recv(b->qp, 51, b->buf, 16, b->mr->lkey);
	sge = (struct ibv_sge){(uintptr_t)a->buf + 4096, 5000, a->mr->lkey};
	w = (struct ibv_send_wr){.wr_id = 2, .sg_list = &sge, .num_sge = 1,
				 .opcode = IBV_WR_RDMA_WRITE};
	w.wr.rdma.remote_addr = (uintptr_t)b->buf + 8192;
	w.wr.rdma.rkey = b->mr->rkey;
	CHECK_RET(ibv_post_send(a->qp, &w, &bad), 0);
	w.wr_id = 3;
	w.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
	w.imm_data = htobe32(77);
	w.wr.rdma.remote_addr = (uintptr_t)b->buf + 16384;
	CHECK_RET(ibv_post_send(a->qp, &w, &bad), 0);
	EXPECT_WC(a->cq, &wc, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE);
	CHECK_EQ(wc.wr_id, 2);
	EXPECT_WC(a->cq, &wc, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE);
	CHECK_EQ(wc.wr_id, 3);
	EXPECT_WC(b->cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV_RDMA_WITH_IMM);
	CHECK_EQ(wc.wr_id, 51);
	CHECK_EQ(be32toh(wc.imm_data), 77);
	CHECK_MEM(b->buf + 8192, a->buf + 4096, 5000);
	CHECK_MEM(b->buf + 16384, a->buf + 4096, 5000);

	/* READ and atomics are not UC operations: EINVAL, bad_wr names the request, and
	 * the one before it in the list is posted. */
	struct ibv_sge s8 = {(uintptr_t)a->buf, 8, a->mr->lkey};
	const enum ibv_wr_opcode ops[] = {IBV_WR_RDMA_READ, IBV_WR_ATOMIC_FETCH_AND_ADD,
					  IBV_WR_ATOMIC_CMP_AND_SWP};
	for (size_t i = 0; i < sizeof(ops) / sizeof(ops[0]); i++) {
		struct ibv_send_wr ok = {.wr_id = 10 + i, .sg_list = &s8, .num_sge = 1,
					 .opcode = IBV_WR_RDMA_WRITE};
		ok.wr.rdma.remote_addr = (uintptr_t)b->buf;
		ok.wr.rdma.rkey = b->mr->rkey;
		struct ibv_send_wr no = {.wr_id = 20 + i, .sg_list = &s8, .num_sge = 1,
					 .opcode = ops[i]};
		no.wr.atomic.remote_addr = (uintptr_t)b->buf;
		no.wr.atomic.rkey = b->mr->rkey;
		ok.next = &no;
		bad = NULL;
		CHECK_RET(ibv_post_send(a->qp, &ok, &bad), EINVAL);
		CHECK(bad == &no);
		EXPECT_WC(a->cq, &wc, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE);
		CHECK_EQ(wc.wr_id, 10 + i);
	}
	EXPECT_NO_WC(a->cq, 20);
	EXPECT_NO_WC(b->cq, 20);
}

int main(void)
{
	struct side a, b;
	side_open(&a, "rb0", LEN, 256);
	side_open(&b, "rb1", LEN, 256);
	uc_qp(&a);
	uc_qp(&b);
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qi;
	CHECK_RET(ibv_query_qp(a.qp, &qa, IBV_QP_STATE, &qi), 0);
	CHECK_EQ(qi.qp_type, IBV_QPT_UC);
	CHECK_EQ(qa.qp_state, IBV_QPS_RESET);
	uc_connect(a.qp, b.qp->qp_num, &b.gid);
	uc_connect(b.qp, a.qp->qp_num, &a.gid);
	CHECK_RET(ibv_query_qp(a.qp, &qa, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_DEST_QPN, &qi),
		  0);
	CHECK_EQ(qa.qp_state, IBV_QPS_RTS);
	CHECK_EQ(qa.sq_psn, 0x77);
	CHECK_EQ(qa.dest_qp_num, b.qp->qp_num);
	traffic(&a, &b);

	/* The builder: a UC QP takes SEND and WRITE operations only. */
	struct ibv_qp_init_attr_ex ax = {
		.send_cq = a.cq,
		.recv_cq = a.cq,
		.cap = {.max_send_wr = 8, .max_recv_wr = 8, .max_send_sge = 1, .max_recv_sge = 1},
		.qp_type = IBV_QPT_UC,
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
		.pd = a.pd,
		.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_RDMA_READ,
	};
	CHECK_NULL_ERRNO(ibv_create_qp_ex(a.ctx, &ax), EOPNOTSUPP);
	ax.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM |
			    IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM;
	struct ibv_qp *qx = ibv_create_qp_ex(a.ctx, &ax);
	CHECK(qx != NULL);
	CHECK_EQ(qx->qp_type, IBV_QPT_UC);
	CHECK(ibv_qp_to_qp_ex(qx) != NULL);
	CHECK_RET(ibv_destroy_qp(qx), 0);

	side_close(&a);
	side_close(&b);
	printf("uc: ok\n");
	return 0;
}
