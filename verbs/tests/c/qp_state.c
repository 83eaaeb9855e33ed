/* Queue pairs: creation (classic and extended, capacities written back), every state
 * transition with ibv_query_qp after it, refused transitions (missing or extra mask bits,
 * skipped states, bad attributes) that leave the state unchanged, unsupported QP types,
 * posting in RESET, too many SGEs, a full send queue, RTS -> ERR -> RESET and back, double
 * destroy, and ibv_close_device with objects still alive. */
#include "common.h"

static struct side a, b;
static struct qp_opts o;

static enum ibv_qp_state state_of(struct ibv_qp *qp)
{
	struct ibv_qp_attr at;
	struct ibv_qp_init_attr ia;
	CHECK_RET(ibv_query_qp(qp, &at, IBV_QP_STATE, &ia), 0);
	return at.qp_state;
}

/* A modify that must fail with EINVAL and leave the QP in `st`. */
#define REFUSED(qp, attr, mask, st)                                                      \
	do {                                                                             \
		CHECK_RET(ibv_modify_qp((qp), (attr), (mask)), EINVAL);                  \
		CHECK_EQ(state_of(qp), (st));                                            \
		CHECK_EQ((qp)->state, (st));                                             \
	} while (0)

static void create_and_transitions(void)
{
	/* ---- classic creation: capacities written back ---- */
	int cookie;
	struct ibv_qp_init_attr ia = {
		.qp_context = &cookie,
		.send_cq = a.cq,
		.recv_cq = a.cq,
		.cap = {.max_send_wr = 10,
			.max_recv_wr = 5,
			.max_send_sge = 3,
			.max_recv_sge = 2,
			.max_inline_data = 32},
		.qp_type = IBV_QPT_RC,
	};
	struct ibv_qp *qp = ibv_create_qp(a.pd, &ia);
	CHECK(qp != NULL);
	CHECK(ia.cap.max_send_wr >= 10);
	CHECK(ia.cap.max_recv_wr >= 5);
	CHECK(ia.cap.max_send_sge >= 3);
	CHECK(ia.cap.max_recv_sge >= 2);
	CHECK(ia.cap.max_inline_data >= 32);
	CHECK(qp->qp_num != 0);
	CHECK(qp->context == a.ctx);
	CHECK(qp->pd == a.pd);
	CHECK(qp->send_cq == a.cq);
	CHECK(qp->recv_cq == a.cq);
	CHECK(qp->srq == NULL);
	CHECK(qp->qp_context == &cookie);
	CHECK_EQ(qp->qp_type, IBV_QPT_RC);
	CHECK_EQ(qp->state, IBV_QPS_RESET);
	/* A classic QP has no builder. */
	CHECK(ibv_qp_to_qp_ex(qp) == NULL);
	{
		/* No inline data asked for: the room one 64-byte WQE leaves after its control and
		 * address segments and the inline header (28 bytes, as mlx5 reports it), which
		 * programs that send small messages inline without asking rely on. */
		struct ibv_qp_init_attr z = ia;
		z.cap.max_send_sge = 1;
		z.cap.max_inline_data = 0;
		struct ibv_qp *zq = ibv_create_qp(a.pd, &z);
		CHECK(zq != NULL);
		CHECK_EQ(z.cap.max_inline_data, 28);
		CHECK_RET(ibv_destroy_qp(zq), 0);
	}

	struct ibv_qp_attr at;
	struct ibv_qp_init_attr qi;
	memset(&qi, 0xa5, sizeof(qi));
	CHECK_RET(ibv_query_qp(qp, &at, IBV_QP_STATE | IBV_QP_CAP, &qi), 0);
	CHECK_EQ(at.qp_state, IBV_QPS_RESET);
	CHECK_EQ(qi.cap.max_send_wr, ia.cap.max_send_wr);
	CHECK_EQ(qi.cap.max_recv_wr, ia.cap.max_recv_wr);
	CHECK_EQ(qi.cap.max_send_sge, ia.cap.max_send_sge);
	CHECK_EQ(qi.cap.max_recv_sge, ia.cap.max_recv_sge);
	CHECK_EQ(qi.cap.max_inline_data, ia.cap.max_inline_data);
	CHECK(qi.send_cq == a.cq);
	CHECK(qi.recv_cq == a.cq);
	CHECK(qi.qp_context == &cookie);
	CHECK_EQ(qi.qp_type, IBV_QPT_RC);
	CHECK_RET(ibv_query_qp(qp, NULL, IBV_QP_STATE, &qi), EINVAL);

	/* Posting in RESET: refused, bad_wr names the request. */
	struct ibv_sge sge = {.addr = (uintptr_t)a.buf, .length = 8, .lkey = a.mr->lkey};
	struct ibv_send_wr swr = {.wr_id = 1, .sg_list = &sge, .num_sge = 1,
				  .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED};
	struct ibv_send_wr *sbad = NULL;
	CHECK_RET(ibv_post_send(qp, &swr, &sbad), EINVAL);
	CHECK(sbad == &swr);
	struct ibv_recv_wr rwr = {.wr_id = 2, .sg_list = &sge, .num_sge = 1}, *rbad = NULL;
	CHECK(ibv_post_recv(qp, &rwr, &rbad) != 0);
	CHECK(rbad == &rwr);

	/* ---- RESET -> INIT ---- */
	struct ibv_qp_attr init = {
		.qp_state = IBV_QPS_INIT,
		.port_num = 1,
		.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ,
	};
	int init_mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
	/* Skipping INIT, a missing required bit, a bit INIT does not take, a bad port, an
	 * unknown state and unknown access bits are all refused. */
	struct ibv_qp_attr rtr_direct = rtr_attr(b.qp->qp_num, &b.gid, &o);
	REFUSED(qp, &rtr_direct, RTR_MASK, IBV_QPS_RESET);
	REFUSED(qp, &init, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT, IBV_QPS_RESET);
	REFUSED(qp, &init, init_mask | IBV_QP_SQ_PSN, IBV_QPS_RESET);
	REFUSED(qp, &init, init_mask | IBV_QP_AV, IBV_QPS_RESET);
	struct ibv_qp_attr bad = init;
	bad.port_num = 2;
	REFUSED(qp, &bad, init_mask, IBV_QPS_RESET);
	bad = init;
	bad.qp_state = 42;
	REFUSED(qp, &bad, init_mask, IBV_QPS_RESET);
	bad = init;
	bad.qp_access_flags |= IBV_ACCESS_MW_BIND << 8;
	REFUSED(qp, &bad, init_mask, IBV_QPS_RESET);
	CHECK_RET(ibv_modify_qp(qp, NULL, init_mask), EINVAL);
	CHECK_RET(ibv_modify_qp(qp, &init, init_mask), 0);
	CHECK_EQ(qp->state, IBV_QPS_INIT);
	CHECK_RET(ibv_query_qp(qp, &at, IBV_QP_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_PORT, &qi),
		  0);
	CHECK_EQ(at.qp_state, IBV_QPS_INIT);
	CHECK_EQ(at.qp_access_flags, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
	CHECK_EQ(at.port_num, 1);
	/* INIT -> INIT may change the access flags. */
	init.qp_access_flags = ACC_ALL;
	CHECK_RET(ibv_modify_qp(qp, &init, IBV_QP_STATE | IBV_QP_ACCESS_FLAGS), 0);
	CHECK_RET(ibv_query_qp(qp, &at, IBV_QP_ACCESS_FLAGS, &qi), 0);
	CHECK_EQ(at.qp_access_flags & ~IBV_ACCESS_LOCAL_WRITE,
		  ACC_ALL & ~IBV_ACCESS_LOCAL_WRITE);
	/* Receives may be posted from INIT on. */
	rbad = NULL;
	CHECK_RET(ibv_post_recv(qp, &rwr, &rbad), 0);
	/* Sends may not. */
	sbad = NULL;
	CHECK_RET(ibv_post_send(qp, &swr, &sbad), EINVAL);
	CHECK(sbad == &swr);

	/* ---- INIT -> RTR ---- */
	struct ibv_qp_attr rtr = rtr_attr(b.qp->qp_num, &b.gid, &o);
	rtr.rq_psn = 0x123456;
	REFUSED(qp, &rtr, RTR_MASK & ~IBV_QP_AV, IBV_QPS_INIT);
	REFUSED(qp, &rtr, RTR_MASK & ~IBV_QP_DEST_QPN, IBV_QPS_INIT);
	REFUSED(qp, &rtr, RTR_MASK & ~IBV_QP_PATH_MTU, IBV_QPS_INIT);
	REFUSED(qp, &rtr, RTR_MASK | IBV_QP_SQ_PSN, IBV_QPS_INIT);
	REFUSED(qp, &rtr, RTR_MASK | IBV_QP_RETRY_CNT, IBV_QPS_INIT);
	bad = rtr;
	bad.ah_attr.is_global = 0;
	REFUSED(qp, &bad, RTR_MASK, IBV_QPS_INIT);
	bad = rtr;
	bad.ah_attr.grh.sgid_index = 1;
	REFUSED(qp, &bad, RTR_MASK, IBV_QPS_INIT);
	bad = rtr;
	memset(&bad.ah_attr.grh.dgid, 0, 16);
	bad.ah_attr.grh.dgid.raw[0] = 0xfe;
	bad.ah_attr.grh.dgid.raw[1] = 0x80;
	REFUSED(qp, &bad, RTR_MASK, IBV_QPS_INIT);
	struct ibv_qp_attr rts0 = {.qp_state = IBV_QPS_RTS};
	REFUSED(qp, &rts0, RTS_MASK, IBV_QPS_INIT);
	CHECK_RET(ibv_modify_qp(qp, &rtr, RTR_MASK), 0);
	CHECK_EQ(qp->state, IBV_QPS_RTR);
	memset(&at, 0xa5, sizeof(at));
	CHECK_RET(ibv_query_qp(qp, &at,
			       IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
				       IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
				       IBV_QP_MIN_RNR_TIMER,
			       &qi),
		  0);
	CHECK_EQ(at.qp_state, IBV_QPS_RTR);
	CHECK_EQ(at.dest_qp_num, b.qp->qp_num);
	CHECK_EQ(at.rq_psn, 0x123456);
	CHECK_EQ(at.path_mtu, IBV_MTU_1024);
	CHECK_EQ(at.ah_attr.is_global, 1);
	CHECK_MEM(at.ah_attr.grh.dgid.raw, b.gid.raw, 16);
	CHECK_EQ(at.ah_attr.grh.sgid_index, 0);
	CHECK_EQ(at.max_dest_rd_atomic, o.max_rd_atomic);
	CHECK_EQ(at.min_rnr_timer, o.min_rnr_timer);

	/* ---- RTR -> RTS ---- */
	struct ibv_qp_attr rts = {
		.qp_state = IBV_QPS_RTS,
		.timeout = 14,
		.retry_cnt = 6,
		.rnr_retry = 5,
		.sq_psn = 0xabcdef,
		.max_rd_atomic = 2,
	};
	REFUSED(qp, &rts, RTS_MASK & ~IBV_QP_SQ_PSN, IBV_QPS_RTR);
	REFUSED(qp, &rts, RTS_MASK | IBV_QP_DEST_QPN, IBV_QPS_RTR);
	CHECK_RET(ibv_modify_qp(qp, &rts, RTS_MASK), 0);
	CHECK_EQ(qp->state, IBV_QPS_RTS);
	memset(&at, 0xa5, sizeof(at));
	CHECK_RET(ibv_query_qp(qp, &at, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_RQ_PSN |
				       IBV_QP_DEST_QPN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
				       IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC |
				       IBV_QP_PATH_MTU | IBV_QP_AV,
			       &qi),
		  0);
	CHECK_EQ(at.qp_state, IBV_QPS_RTS);
	CHECK_EQ(at.sq_psn, 0xabcdef);
	CHECK_EQ(at.rq_psn, 0x123456);
	CHECK_EQ(at.dest_qp_num, b.qp->qp_num);
	CHECK_EQ(at.timeout, 14);
	CHECK_EQ(at.retry_cnt, 6);
	CHECK_EQ(at.rnr_retry, 5);
	CHECK_EQ(at.max_rd_atomic, 2);
	CHECK_EQ(at.path_mtu, IBV_MTU_1024);
	CHECK_MEM(at.ah_attr.grh.dgid.raw, b.gid.raw, 16);
	/* RTS -> RTS with nothing but a new timer is fine. */
	struct ibv_qp_attr rts2 = {.qp_state = IBV_QPS_RTS, .min_rnr_timer = 3};
	CHECK_RET(ibv_modify_qp(qp, &rts2, IBV_QP_STATE | IBV_QP_MIN_RNR_TIMER), 0);
	/* RTS -> INIT is not a transition. */
	REFUSED(qp, &init, init_mask, IBV_QPS_RTS);

	/* ---- RTS -> ERR -> RESET -> ... -> RTS, then traffic ---- */
	struct ibv_qp_attr err = {.qp_state = IBV_QPS_ERR};
	CHECK_RET(ibv_modify_qp(qp, &err, IBV_QP_STATE), 0);
	CHECK_EQ(state_of(qp), IBV_QPS_ERR);
	/* The receive posted in INIT is flushed. */
	struct ibv_wc wc;
	EXPECT_WC(a.cq, &wc, IBV_WC_WR_FLUSH_ERR, -1);
	CHECK_EQ(wc.wr_id, 2);
	CHECK_EQ(wc.qp_num, qp->qp_num);
	struct ibv_qp_attr reset = {.qp_state = IBV_QPS_RESET};
	CHECK_RET(ibv_modify_qp(qp, &reset, IBV_QP_STATE), 0);
	CHECK_EQ(state_of(qp), IBV_QPS_RESET);
	/* b's QP, connected to qp from scratch. */
	qp_connect(qp, b.qp->qp_num, &b.gid, &o);
	qp_connect(b.qp, qp->qp_num, &a.gid, &o);
	post_recv(b.qp, 7, b.buf, 64, b.mr->lkey);
	fill(a.buf, 64, 1);
	post_send_buf(qp, 8, a.buf, 64, a.mr->lkey);
	EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	CHECK_EQ(wc.wr_id, 8);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 7);
	CHECK_MEM(b.buf, a.buf, 64);

	CHECK_RET(ibv_destroy_qp(qp), 0);
	CHECK_RET(ibv_destroy_qp(qp), EINVAL);
	CHECK_RET(ibv_query_qp(qp, &at, IBV_QP_STATE, &qi), EINVAL);
	CHECK_RET(ibv_modify_qp(qp, &reset, IBV_QP_STATE), EINVAL);
	printf("  classic QP: every transition, refusals, ERR and back\n");
}

static void extended_create(void)
{
	struct ibv_qp_init_attr_ex ax = {
		.send_cq = a.cq,
		.recv_cq = a.cq,
		.cap = {.max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1},
		.qp_type = IBV_QPT_RC,
		.comp_mask = IBV_QP_INIT_ATTR_PD,
		.pd = a.pd,
	};
	struct ibv_qp *qp = ibv_create_qp_ex(a.ctx, &ax);
	CHECK(qp != NULL);
	CHECK(ax.cap.max_send_wr >= 4);
	CHECK(ibv_qp_to_qp_ex(qp) == NULL);
	CHECK_RET(ibv_destroy_qp(qp), 0);

	ax.comp_mask |= IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
	ax.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_RDMA_WRITE;
	qp = ibv_create_qp_ex(a.ctx, &ax);
	CHECK(qp != NULL);
	struct ibv_qp_ex *qx = ibv_qp_to_qp_ex(qp);
	CHECK(qx != NULL);
	CHECK(&qx->qp_base == qp);
	CHECK_RET(ibv_destroy_qp(qp), 0);

	/* Send operations the device cannot build are refused. */
	ax.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_TSO;
	CHECK_NULL_ERRNO(ibv_create_qp_ex(a.ctx, &ax), EOPNOTSUPP);
	/* Without a PD. */
	ax.comp_mask = 0;
	CHECK_NULL_ERRNO(ibv_create_qp_ex(a.ctx, &ax), EINVAL);

	/* An XRC target without its XRC domain (xrc.c has XRC). */
	{
		struct ibv_qp_init_attr ia = {.send_cq = a.cq, .recv_cq = a.cq,
					      .qp_type = IBV_QPT_XRC_RECV};
		CHECK_NULL_ERRNO(ibv_create_qp(a.pd, &ia), EINVAL);
		struct ibv_qp_init_attr_ex iax = {.qp_type = IBV_QPT_XRC_RECV,
						  .comp_mask = IBV_QP_INIT_ATTR_PD, .pd = a.pd};
		CHECK_NULL_ERRNO(ibv_create_qp_ex(a.ctx, &iax), EINVAL);
	}

	/* Unsupported types (raw packet QPs are supported since ABI 1.12: raw.c). */
	const enum ibv_qp_type types[] = {IBV_QPT_DRIVER};
	for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
		struct ibv_qp_init_attr ia = {
			.send_cq = a.cq,
			.recv_cq = a.cq,
			.cap = {.max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1,
				.max_recv_sge = 1},
			.qp_type = types[i],
		};
		errno = 0;
		struct ibv_qp *q = ibv_create_qp(a.pd, &ia);
		if (q != NULL || errno != EOPNOTSUPP)
			FAIL("QP type %d: got %p errno %d, want NULL and EOPNOTSUPP", types[i],
			     (void *)q, errno);
		struct ibv_qp_init_attr_ex iax = {
			.send_cq = a.cq,
			.recv_cq = a.cq,
			.cap = ia.cap,
			.qp_type = types[i],
			.comp_mask = IBV_QP_INIT_ATTR_PD,
			.pd = a.pd,
		};
		errno = 0;
		q = ibv_create_qp_ex(a.ctx, &iax);
		if (q != NULL || errno != EOPNOTSUPP)
			FAIL("QP type %d (ex): got %p errno %d, want NULL and EOPNOTSUPP",
			     types[i], (void *)q, errno);
	}

	/* Bad capacities and pointers. */
	struct ibv_device_attr da;
	CHECK_RET(ibv_query_device(a.ctx, &da), 0);
	struct ibv_qp_init_attr ia = {
		.send_cq = a.cq,
		.recv_cq = a.cq,
		.cap = {.max_send_wr = da.max_qp_wr + 1, .max_recv_wr = 1, .max_send_sge = 1,
			.max_recv_sge = 1},
		.qp_type = IBV_QPT_RC,
	};
	CHECK_NULL_ERRNO(ibv_create_qp(a.pd, &ia), EINVAL);
	ia.cap.max_send_wr = 1;
	ia.cap.max_send_sge = da.max_sge + 1;
	CHECK_NULL_ERRNO(ibv_create_qp(a.pd, &ia), EINVAL);
	ia.cap.max_send_sge = 1;
	ia.send_cq = NULL;
	CHECK_NULL_ERRNO(ibv_create_qp(a.pd, &ia), EINVAL);
	/* A CQ of another context. */
	ia.send_cq = b.cq;
	CHECK_NULL_ERRNO(ibv_create_qp(a.pd, &ia), EINVAL);
	ia.send_cq = a.cq;
	CHECK_NULL_ERRNO(ibv_create_qp(a.pd, NULL), EINVAL);
	CHECK_NULL_ERRNO(ibv_create_qp(NULL, &ia), EINVAL);
	printf("  creation: extended, unsupported types, bad capacities\n");
}

/* Too many SGEs, unknown opcodes and flags, a full send queue; bad_wr names the first
 * request refused and the ones before it stay posted. */
static void posting_limits(void)
{
	struct qp_opts small = o;
	small.max_send_wr = 4;
	small.max_recv_wr = 4;
	small.max_send_sge = 2;
	small.max_recv_sge = 2;
	struct side *s = &a;
	struct ibv_qp *qp = side_qp(s, &small);
	struct ibv_qp *peer = side_qp(&b, &o);
	struct ibv_qp_init_attr qi;
	struct ibv_qp_attr at;
	CHECK_RET(ibv_query_qp(qp, &at, IBV_QP_CAP, &qi), 0);
	qp_connect(qp, peer->qp_num, &b.gid, &small);
	qp_connect(peer, qp->qp_num, &a.gid, &o);

	struct ibv_sge sges[40];
	for (int i = 0; i < 40; i++)
		sges[i] = (struct ibv_sge){
			.addr = (uintptr_t)a.buf + 8 * i, .length = 8, .lkey = a.mr->lkey};

	/* Receive: the second request has one SGE too many. */
	struct ibv_recv_wr r2 = {.wr_id = 202, .sg_list = sges,
				 .num_sge = qi.cap.max_recv_sge + 1};
	struct ibv_recv_wr r1 = {.wr_id = 201, .next = &r2, .sg_list = sges, .num_sge = 1};
	struct ibv_recv_wr *rbad = NULL;
	CHECK(ibv_post_recv(qp, &r1, &rbad) != 0);
	CHECK(rbad == &r2);
	/* Negative counts too. */
	r2.num_sge = -1;
	rbad = NULL;
	CHECK(ibv_post_recv(qp, &r2, &rbad) != 0);
	CHECK(rbad == &r2);

	/* Send: too many SGEs (ENOMEM, as rdma-core's providers say), unknown opcode, unknown
	 * flag, inline data beyond max_inline_data. */
	struct ibv_send_wr s1 = {.wr_id = 301, .sg_list = sges, .num_sge = 1,
				 .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED};
	struct ibv_send_wr s2 = s1;
	s2.wr_id = 302;
	s2.num_sge = qi.cap.max_send_sge + 1;
	s1.next = &s2;
	struct ibv_send_wr *sbad = NULL;
	CHECK_RET(ibv_post_send(qp, &s1, &sbad), ENOMEM);
	CHECK(sbad == &s2);
	struct ibv_send_wr s3 = {.wr_id = 303, .sg_list = sges, .num_sge = 1,
				 .opcode = IBV_WR_BIND_MW + 40, .send_flags = IBV_SEND_SIGNALED};
	sbad = NULL;
	CHECK_RET(ibv_post_send(qp, &s3, &sbad), EINVAL);
	CHECK(sbad == &s3);
	s3.opcode = IBV_WR_SEND;
	s3.send_flags = IBV_SEND_SIGNALED | (1u << 20);
	sbad = NULL;
	CHECK_RET(ibv_post_send(qp, &s3, &sbad), EINVAL);
	CHECK(sbad == &s3);
	uint8_t big[4096];
	memset(big, 7, sizeof(big));
	struct ibv_sge bsge = {.addr = (uintptr_t)big, .length = qi.cap.max_inline_data + 1};
	struct ibv_send_wr s4 = {.wr_id = 304, .sg_list = &bsge, .num_sge = 1,
				 .opcode = IBV_WR_SEND,
				 .send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE};
	sbad = NULL;
	CHECK(qi.cap.max_inline_data < sizeof(big));
	CHECK(ibv_post_send(qp, &s4, &sbad) != 0);
	CHECK(sbad == &s4);

	/* r1 and s1 were posted: s1 lands in a receive of the peer, r1 waits. */
	post_recv(peer, 401, b.buf, 64, b.mr->lkey);
	struct ibv_wc wc;
	EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	CHECK_EQ(wc.wr_id, 301);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 401);
	CHECK_EQ(wc.byte_len, 8);

	/* A full send queue: at least max_send_wr requests are taken (the fabric does not
	 * move while posting; small requests may take less room than the largest the QP was
	 * sized for), then one is refused with ENOMEM and bad_wr set. */
	uint32_t room = 0;
	for (;;) {
		struct ibv_send_wr w = {.wr_id = 600 + room, .sg_list = sges, .num_sge = 1,
					.opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED};
		sbad = NULL;
		int r = ibv_post_send(qp, &w, &sbad);
		if (r != 0) {
			CHECK_EQ(r, ENOMEM);
			CHECK(sbad == &w);
			break;
		}
		room++;
		CHECK(room <= 1024);
	}
	CHECK(room >= qi.cap.max_send_wr);
	for (uint32_t i = 0; i < room + 1; i++)
		post_recv(peer, 500 + i, b.buf, 64, b.mr->lkey);
	for (uint32_t i = 0; i < room; i++) {
		EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
		CHECK_EQ(wc.wr_id, 600 + i);
	}
	/* Room again. */
	struct ibv_send_wr more = {.wr_id = 700, .sg_list = sges, .num_sge = 1,
				   .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED};
	sbad = NULL;
	CHECK_RET(ibv_post_send(qp, &more, &sbad), 0);
	EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	CHECK_EQ(wc.wr_id, 700);
	/* The peer got every SEND, in order. */
	for (uint32_t i = 0; i < room + 1; i++) {
		EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
		CHECK_EQ(wc.wr_id, 500 + i);
	}
	CHECK_RET(ibv_destroy_qp(qp), 0);
	CHECK_RET(ibv_destroy_qp(peer), 0);
	a.qp = NULL;
	b.qp = NULL;
	printf("  posting: SGE limits, bad opcode and flags, inline limit, full SQ\n");
}

/* ibv_close_device with a PD, MR, CQs, a channel, an SRQ and QPs still alive. */
static void close_with_objects(void)
{
	struct ibv_context *ctx = open_dev("rb0");
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	CHECK(pd != NULL);
	uint8_t *mem = malloc(4096);
	CHECK(mem != NULL);
	struct ibv_mr *mr = ibv_reg_mr(pd, mem, 4096, ACC_ALL);
	CHECK(mr != NULL);
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	CHECK(ch != NULL);
	struct ibv_cq *cq = ibv_create_cq(ctx, 8, NULL, ch, 0);
	CHECK(cq != NULL);
	struct ibv_srq_init_attr sa = {.attr = {.max_wr = 4, .max_sge = 1}};
	struct ibv_srq *srq = ibv_create_srq(pd, &sa);
	CHECK(srq != NULL);
	struct ibv_qp_init_attr ia = {
		.send_cq = cq,
		.recv_cq = cq,
		.srq = srq,
		.cap = {.max_send_wr = 4, .max_send_sge = 1},
		.qp_type = IBV_QPT_RC,
	};
	struct ibv_qp *qp1 = ibv_create_qp(pd, &ia);
	CHECK(qp1 != NULL);
	ia.srq = NULL;
	ia.cap.max_recv_wr = 4;
	ia.cap.max_recv_sge = 1;
	struct ibv_qp *qp2 = ibv_create_qp(pd, &ia);
	CHECK(qp2 != NULL);
	qp_to_init(qp2);
	post_recv(qp2, 1, mem, 64, mr->lkey);
	CHECK_RET(ibv_close_device(ctx), 0);
	/* Everything went with the context: the handles are dead, not crashes. */
	CHECK_RET(ibv_destroy_qp(qp1), EINVAL);
	CHECK_RET(ibv_destroy_qp(qp2), EINVAL);
	CHECK_RET(ibv_destroy_srq(srq), EINVAL);
	CHECK_RET(ibv_destroy_cq(cq), EINVAL);
	CHECK_RET(ibv_destroy_comp_channel(ch), EINVAL);
	CHECK_RET(ibv_dereg_mr(mr), EINVAL);
	CHECK_RET(ibv_dealloc_pd(pd), EINVAL);
	CHECK_RET(ibv_close_device(ctx), EINVAL);
	/* The memory is the program's again. */
	memset(mem, 1, 4096);
	free(mem);
	/* And the device still serves new contexts. */
	struct ibv_context *again = open_dev("rb0");
	struct ibv_pd *pd2 = ibv_alloc_pd(again);
	CHECK(pd2 != NULL);
	CHECK_RET(ibv_close_device(again), 0);
	printf("  close with objects alive: released\n");
}

int main(void)
{
	o = default_qp_opts();
	side_open(&a, "rb0", 1 << 16, 256);
	side_open(&b, "rb1", 1 << 16, 256);
	side_qp(&b, &o);
	create_and_transitions();
	extended_create();
	CHECK_RET(ibv_destroy_qp(b.qp), 0);
	b.qp = NULL;
	posting_limits();
	close_with_objects();
	side_close(&a);
	side_close(&b);
	printf("qp_state: ok\n");
	return 0;
}
