/* Shared receive queues: creation (classic and ibv_create_srq_ex) and its bad attributes,
 * two QPs receiving through one SRQ from two peers, ibv_post_srq_recv limits, ibv_query_srq,
 * the limit event (IBV_EVENT_SRQ_LIMIT_REACHED through a non-blocking async_fd), refused
 * modifications, EBUSY while a QP uses the SRQ, and the QPs' last-WQE events. */
#include "common.h"

static struct side a, b;
static struct ibv_qp *a2, *b2; /* a second pair: a2 -> b2, b2 on the SRQ too */
static struct ibv_cq *tick;    /* an empty CQ of b's context, to step the fabric */

static void send_from(struct ibv_qp *qp, uint64_t id, uint32_t off, uint32_t len)
{
	post_send_buf(qp, id, a.buf + off, len, a.mr->lkey);
	struct ibv_wc wc;
	EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	CHECK_EQ(wc.wr_id, id);
}

static void creation(void)
{
	struct ibv_device_attr da;
	CHECK_RET(ibv_query_device(b.ctx, &da), 0);
	struct ibv_srq_init_attr sa = {.attr = {.max_wr = 0, .max_sge = 1}};
	CHECK_NULL_ERRNO(ibv_create_srq(b.pd, &sa), EINVAL);
	sa.attr.max_wr = da.max_srq_wr + 1;
	CHECK_NULL_ERRNO(ibv_create_srq(b.pd, &sa), EINVAL);
	sa.attr.max_wr = 4;
	sa.attr.max_sge = da.max_srq_sge + 1;
	CHECK_NULL_ERRNO(ibv_create_srq(b.pd, &sa), EINVAL);
	sa.attr.max_sge = 1;
	sa.attr.srq_limit = 5;
	CHECK_NULL_ERRNO(ibv_create_srq(b.pd, &sa), EINVAL);
	sa.attr.srq_limit = 0;
	CHECK_NULL_ERRNO(ibv_create_srq(NULL, &sa), EINVAL);
	CHECK_NULL_ERRNO(ibv_create_srq(b.pd, NULL), EINVAL);

	/* The extended call, basic type. */
	struct ibv_srq_init_attr_ex sx = {
		.attr = {.max_wr = 4, .max_sge = 1},
		.comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD,
		.srq_type = IBV_SRQT_BASIC,
		.pd = b.pd,
	};
	struct ibv_srq *s = ibv_create_srq_ex(b.ctx, &sx);
	CHECK(s != NULL);
	uint32_t num = 0;
	CHECK_RET(ibv_get_srq_num(s, &num), 0);
	CHECK_RET(ibv_destroy_srq(s), 0);
	CHECK_RET(ibv_destroy_srq(s), EINVAL);
	/* XRC SRQs are not supported; without a PD it is refused. */
	sx.srq_type = IBV_SRQT_XRC;
	CHECK(ibv_create_srq_ex(b.ctx, &sx) == NULL);
	sx.srq_type = IBV_SRQT_BASIC;
	sx.comp_mask = IBV_SRQ_INIT_ATTR_TYPE;
	CHECK_NULL_ERRNO(ibv_create_srq_ex(b.ctx, &sx), EINVAL);
	printf("  creation: bad sizes, limit, pointers refused; ibv_create_srq_ex\n");
}

int main(void)
{
	struct qp_opts o = default_qp_opts();
	side_open(&a, "rb0", 1 << 16, 64);
	side_open(&b, "rb1", 1 << 16, 64);
	tick = ibv_create_cq(b.ctx, 1, NULL, NULL, 0);
	CHECK(tick != NULL);
	creation();

	int cookie;
	struct ibv_srq_init_attr sa = {.srq_context = &cookie,
				       .attr = {.max_wr = 16, .max_sge = 2, .srq_limit = 0}};
	struct ibv_srq *srq = ibv_create_srq(b.pd, &sa);
	CHECK(srq != NULL);
	CHECK(sa.attr.max_wr >= 16);
	CHECK(sa.attr.max_sge >= 2);
	CHECK(srq->context == b.ctx);
	CHECK(srq->pd == b.pd);
	CHECK(srq->srq_context == &cookie);
	struct ibv_srq_attr q;
	CHECK_RET(ibv_query_srq(srq, &q), 0);
	CHECK_EQ(q.max_wr, sa.attr.max_wr);
	CHECK_EQ(q.max_sge, sa.attr.max_sge);
	CHECK_EQ(q.srq_limit, 0);
	CHECK_RET(ibv_query_srq(srq, NULL), EINVAL);

	/* Two QPs of b on the SRQ, each connected to a QP of a. */
	struct qp_opts os = o;
	os.srq = srq;
	side_qp(&a, &o);
	side_qp(&b, &os);
	CHECK(b.qp->srq == srq);
	sides_connect(&a, &o, &b, &os);
	struct side a_2 = a, b_2 = b;
	a2 = side_qp(&a_2, &o);
	b2 = side_qp(&b_2, &os);
	qp_connect(a2, b2->qp_num, &b.gid, &o);
	qp_connect(b2, a2->qp_num, &a.gid, &os);
	CHECK_RET(ibv_destroy_srq(srq), EBUSY);

	/* A QP on an SRQ takes no receives of its own. */
	struct ibv_sge sg = {(uintptr_t)b.buf, 64, b.mr->lkey};
	struct ibv_recv_wr rw = {.wr_id = 1, .sg_list = &sg, .num_sge = 1}, *rbad = NULL;
	CHECK(ibv_post_recv(b.qp, &rw, &rbad) != 0);
	CHECK(rbad == &rw);

	/* Receives: one with two scatter entries; a list whose second has too many. */
	struct ibv_sge two[2] = {{(uintptr_t)b.buf, 100, b.mr->lkey},
				 {(uintptr_t)b.buf + 1000, 1000, b.mr->lkey}};
	struct ibv_sge three[3] = {{(uintptr_t)b.buf, 8, b.mr->lkey},
				   {(uintptr_t)b.buf + 8, 8, b.mr->lkey},
				   {(uintptr_t)b.buf + 16, 8, b.mr->lkey}};
	struct ibv_recv_wr r2 = {.wr_id = 11, .sg_list = three, .num_sge = 3};
	struct ibv_recv_wr r1 = {.wr_id = 10, .next = &r2, .sg_list = two, .num_sge = 2};
	rbad = NULL;
	CHECK(ibv_post_srq_recv(srq, &r1, &rbad) != 0);
	CHECK(rbad == &r2);
	for (int i = 0; i < 5; i++)
		post_srq_recv(srq, 20 + i, b.buf + 4096 * (i + 1), 4096, b.mr->lkey);

	/* Traffic from both peers lands in the SRQ's buffers, in posting order. */
	fill(a.buf, 8192, 1);
	send_from(a.qp, 100, 0, 700);
	struct ibv_wc wc;
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 10);
	CHECK_EQ(wc.qp_num, b.qp->qp_num);
	CHECK_EQ(wc.byte_len, 700);
	CHECK_MEM(b.buf, a.buf, 100);
	CHECK_MEM(b.buf + 1000, a.buf + 100, 600);
	send_from(a2, 101, 1000, 333);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 20);
	CHECK_EQ(wc.qp_num, b2->qp_num);
	CHECK_EQ(wc.byte_len, 333);
	CHECK_MEM(b.buf + 4096, a.buf + 1000, 333);
	send_from(a.qp, 102, 2000, 4096);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 21);
	CHECK_EQ(wc.qp_num, b.qp->qp_num);
	CHECK_MEM(b.buf + 8192, a.buf + 2000, 4096);
	printf("  traffic: two QPs, two peers, one SRQ\n");

	/* The limit: 3 receives left (22..24), then 5 more posted: 8. Armed at 4, nothing
	 * fires while 4 or more are left; the event comes once fewer are. */
	for (int i = 0; i < 5; i++)
		post_srq_recv(srq, 30 + i, b.buf + 24576 + 1024 * i, 1024, b.mr->lkey);
	struct ibv_srq_attr lim = {.srq_limit = 4};
	CHECK_RET(ibv_modify_srq(srq, &lim, IBV_SRQ_LIMIT), 0);
	CHECK_RET(ibv_query_srq(srq, &q), 0);
	CHECK_EQ(q.srq_limit, 4);
	set_nonblock(b.ctx->async_fd);
	struct ibv_async_event ev;
	for (int i = 0; i < 4; i++) {
		send_from(i % 2 ? a2 : a.qp, 110 + i, 0, 64);
		EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	}
	/* 4 left: not below the limit. */
	step(tick, 100);
	errno = 0;
	if (ibv_get_async_event(b.ctx, &ev) == 0)
		FAIL("async event %d (%s) with 4 receives left and the limit at 4",
		     ev.event_type, ibv_event_type_str(ev.event_type));
	CHECK_EQ(errno, EAGAIN);
	send_from(a.qp, 114, 0, 64);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	if (!wait_async(b.ctx, tick, IBV_EVENT_SRQ_LIMIT_REACHED, &ev))
		FAIL("no IBV_EVENT_SRQ_LIMIT_REACHED with 3 receives left and the limit at 4");
	CHECK(ev.element.srq == srq);
	ibv_ack_async_event(&ev);
	/* The limit disarms when it fires. */
	CHECK_RET(ibv_query_srq(srq, &q), 0);
	CHECK_EQ(q.srq_limit, 0);
	send_from(a.qp, 115, 0, 64);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	step(tick, 100);
	errno = 0;
	CHECK_EQ(ibv_get_async_event(b.ctx, &ev), -1);
	CHECK_EQ(errno, EAGAIN);
	printf("  limit: armed at 4, fired below it, disarmed\n");

	/* Refused modifications leave the limit as it was. */
	struct ibv_srq_attr m = {.max_wr = 64};
	CHECK_RET(ibv_modify_srq(srq, &m, IBV_SRQ_MAX_WR), EINVAL);
	m.srq_limit = q.max_wr + 1;
	CHECK_RET(ibv_modify_srq(srq, &m, IBV_SRQ_LIMIT), EINVAL);
	CHECK_RET(ibv_modify_srq(srq, &m, 1 << 7), EINVAL);
	CHECK_RET(ibv_modify_srq(srq, NULL, IBV_SRQ_LIMIT), EINVAL);
	CHECK_RET(ibv_query_srq(srq, &q), 0);
	CHECK_EQ(q.srq_limit, 0);

	/* A QP on an SRQ that goes to ERR reports its last WQE reached. */
	struct ibv_qp_attr err = {.qp_state = IBV_QPS_ERR};
	CHECK_RET(ibv_modify_qp(b2, &err, IBV_QP_STATE), 0);
	int got = wait_async_for(b.ctx, tick, IBV_EVENT_QP_LAST_WQE_REACHED, &ev, 0.5);
	CHECK(got);
	CHECK(ev.element.qp == b2);
	ibv_ack_async_event(&ev);
	printf("  last WQE reached after ERR\n");

	/* Teardown: EBUSY until no QP uses the SRQ. */
	CHECK_RET(ibv_destroy_qp(b2), 0);
	CHECK_RET(ibv_destroy_srq(srq), EBUSY);
	CHECK_RET(ibv_destroy_qp(b.qp), 0);
	b.qp = NULL;
	CHECK_RET(ibv_destroy_srq(srq), 0);
	CHECK_RET(ibv_destroy_srq(srq), EINVAL);
	CHECK_RET(ibv_destroy_qp(a2), 0);
	CHECK_RET(ibv_destroy_cq(tick), 0);
	side_close(&a);
	side_close(&b);
	printf("srq: ok\n");
	return 0;
}
