/* Error completions of RC QPs, each on a fresh connected pair: a bad lkey, an SGE beyond its
 * MR, a bad rkey, an MR without the remote access asked for, a remote range beyond the MR,
 * a receive too small, a receive with a bad lkey, a misaligned atomic, RNR retries
 * exhausted, transport retries exhausted (no responder QP); after each, the QP is in ERR and
 * whatever is posted next is flushed. */
#include "common.h"

static struct side a, b;

static void drain(struct ibv_cq *cq)
{
	struct ibv_wc wc;
	for (int i = 0; i < 200; i++)
		(void)ibv_poll_cq(cq, 1, &wc);
}

/* New connected QPs on a and b. */
static void fresh(const struct qp_opts *o)
{
	drain(a.cq);
	drain(b.cq);
	if (a.qp)
		CHECK_RET(ibv_destroy_qp(a.qp), 0);
	if (b.qp)
		CHECK_RET(ibv_destroy_qp(b.qp), 0);
	side_qp(&a, o);
	side_qp(&b, o);
	sides_connect(&a, o, &b, o);
}

static enum ibv_qp_state state_of(struct ibv_qp *qp)
{
	struct ibv_qp_attr at;
	struct ibv_qp_init_attr ia;
	CHECK_RET(ibv_query_qp(qp, &at, IBV_QP_STATE, &ia), 0);
	return at.qp_state;
}

static struct ibv_send_wr rdma_wr(uint64_t id, enum ibv_wr_opcode op, struct ibv_sge *sge,
				  uint64_t raddr, uint32_t rkey)
{
	struct ibv_send_wr w = {.wr_id = id, .sg_list = sge, .num_sge = 1, .opcode = op,
				.send_flags = IBV_SEND_SIGNALED};
	w.wr.rdma.remote_addr = raddr;
	w.wr.rdma.rkey = rkey;
	return w;
}

static void post(struct ibv_qp *qp, struct ibv_send_wr *w)
{
	struct ibv_send_wr *bad = NULL;
	CHECK_RET(ibv_post_send(qp, w, &bad), 0);
}

/* The requester's QP went to ERR: a SEND and a receive posted now are flushed. */
static void flushed_after(const char *what)
{
	CHECK_EQ(state_of(a.qp), IBV_QPS_ERR);
	struct ibv_wc wc;
	post_send_buf(a.qp, 900, a.buf, 8, a.mr->lkey);
	post_recv(a.qp, 901, a.buf, 8, a.mr->lkey);
	EXPECT_WC(a.cq, &wc, IBV_WC_WR_FLUSH_ERR, -1);
	CHECK_EQ(wc.wr_id, 900);
	EXPECT_WC(a.cq, &wc, IBV_WC_WR_FLUSH_ERR, -1);
	CHECK_EQ(wc.wr_id, 901);
	printf("  %s; then ERR, later requests flushed\n", what);
}

/* One request that must complete at a with `st`. */
static void expect_fail(struct ibv_send_wr *w, enum ibv_wc_status st)
{
	post(a.qp, w);
	struct ibv_wc wc;
	EXPECT_WC(a.cq, &wc, st, -1);
	CHECK_EQ(wc.wr_id, w->wr_id);
	CHECK_EQ(wc.qp_num, a.qp->qp_num);
}

int main(void)
{
	struct qp_opts o = default_qp_opts();
	side_open(&a, "rb0", 1 << 16, 64);
	side_open(&b, "rb1", 1 << 16, 64);
	struct ibv_wc wc;

	/* Bad lkey. */
	fresh(&o);
	post_recv(b.qp, 1, b.buf, 64, b.mr->lkey);
	struct ibv_sge sge = {(uintptr_t)a.buf, 16, a.mr->lkey ^ 0x5500};
	struct ibv_send_wr w = {.wr_id = 10, .sg_list = &sge, .num_sge = 1,
				.opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED};
	expect_fail(&w, IBV_WC_LOC_PROT_ERR);
	flushed_after("bad lkey: IBV_WC_LOC_PROT_ERR");

	/* A gather entry past the end of its MR. */
	fresh(&o);
	post_recv(b.qp, 1, b.buf, 8192, b.mr->lkey);
	sge = (struct ibv_sge){(uintptr_t)a.buf + a.len - 100, 200, a.mr->lkey};
	w.wr_id = 11;
	expect_fail(&w, IBV_WC_LOC_PROT_ERR);
	flushed_after("SGE beyond its MR: IBV_WC_LOC_PROT_ERR");

	/* Bad rkey on a WRITE. */
	fresh(&o);
	sge = (struct ibv_sge){(uintptr_t)a.buf, 64, a.mr->lkey};
	w = rdma_wr(12, IBV_WR_RDMA_WRITE, &sge, (uintptr_t)b.buf, b.mr->rkey ^ 0x3300);
	expect_fail(&w, IBV_WC_REM_ACCESS_ERR);
	flushed_after("bad rkey on WRITE: IBV_WC_REM_ACCESS_ERR");
	/* The responder's QP went to ERR too, with its affiliated event. */
	{
		struct ibv_cq *tick = ibv_create_cq(b.ctx, 1, NULL, NULL, 0);
		CHECK(tick != NULL);
		set_nonblock(b.ctx->async_fd);
		struct ibv_async_event ev;
		if (!wait_async(b.ctx, tick, IBV_EVENT_QP_ACCESS_ERR, &ev))
			FAIL("no IBV_EVENT_QP_ACCESS_ERR at the responder of a bad rkey");
		CHECK(ev.element.qp == b.qp);
		ibv_ack_async_event(&ev);
		CHECK_EQ(state_of(b.qp), IBV_QPS_ERR);
		CHECK_RET(ibv_destroy_cq(tick), 0);
		/* Later error events of the responder are not checked. */
		int fl = fcntl(b.ctx->async_fd, F_GETFL);
		CHECK(fcntl(b.ctx->async_fd, F_SETFL, fl & ~O_NONBLOCK) == 0);
		printf("  responder: IBV_EVENT_QP_ACCESS_ERR, QP in ERR\n");
	}

	/* A remote range past the end of the MR. */
	fresh(&o);
	w = rdma_wr(13, IBV_WR_RDMA_WRITE, &sge, (uintptr_t)b.buf + b.len - 32, b.mr->rkey);
	expect_fail(&w, IBV_WC_REM_ACCESS_ERR);
	flushed_after("remote range beyond the MR: IBV_WC_REM_ACCESS_ERR");

	/* MRs without the remote access asked for. */
	{
		uint8_t *mem = malloc(4096);
		CHECK(mem != NULL);
		memset(mem, 0x11, 4096);
		struct ibv_mr *ro = ibv_reg_mr(b.pd, mem, 2048,
					       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
		struct ibv_mr *wo = ibv_reg_mr(b.pd, mem + 2048, 2048,
					       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
		CHECK(ro != NULL && wo != NULL);
		fresh(&o);
		w = rdma_wr(14, IBV_WR_RDMA_WRITE, &sge, (uintptr_t)mem, ro->rkey);
		expect_fail(&w, IBV_WC_REM_ACCESS_ERR);
		uint8_t ones[64];
		memset(ones, 0x11, sizeof(ones));
		CHECK_MEM(mem, ones, 64);
		flushed_after("WRITE into a REMOTE_READ-only MR: IBV_WC_REM_ACCESS_ERR");
		fresh(&o);
		w = rdma_wr(15, IBV_WR_RDMA_READ, &sge, (uintptr_t)mem + 2048, wo->rkey);
		expect_fail(&w, IBV_WC_REM_ACCESS_ERR);
		flushed_after("READ from a REMOTE_WRITE-only MR: IBV_WC_REM_ACCESS_ERR");
		fresh(&o);
		struct ibv_sge at = {(uintptr_t)a.buf, 8, a.mr->lkey};
		struct ibv_send_wr aw = {.wr_id = 16, .sg_list = &at, .num_sge = 1,
					 .opcode = IBV_WR_ATOMIC_FETCH_AND_ADD,
					 .send_flags = IBV_SEND_SIGNALED};
		aw.wr.atomic.remote_addr = (uintptr_t)mem;
		aw.wr.atomic.rkey = ro->rkey;
		aw.wr.atomic.compare_add = 1;
		expect_fail(&aw, IBV_WC_REM_ACCESS_ERR);
		flushed_after("atomic on an MR without REMOTE_ATOMIC: IBV_WC_REM_ACCESS_ERR");
		/* A misaligned atomic: refused when posted (EINVAL, bad_wr set, the QP stays in
		 * RTS), or, as a device that does not check at post time does, completed with
		 * IBV_WC_REM_INV_REQ_ERR. */
		fresh(&o);
		aw.wr_id = 17;
		aw.wr.atomic.remote_addr = (uintptr_t)b.buf + 4;
		aw.wr.atomic.rkey = b.mr->rkey;
		struct ibv_send_wr *bad = NULL;
		int r = ibv_post_send(a.qp, &aw, &bad);
		if (r != 0) {
			CHECK_EQ(r, EINVAL);
			CHECK(bad == &aw);
			CHECK_EQ(state_of(a.qp), IBV_QPS_RTS);
			EXPECT_NO_WC(a.cq, 50);
			aw.wr.atomic.remote_addr = (uintptr_t)b.buf + 8;
			*(uint64_t *)(void *)(b.buf + 8) = 41;
			post(a.qp, &aw);
			EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_FETCH_ADD);
			CHECK_EQ(*(uint64_t *)(void *)(b.buf + 8), 42);
			printf("  misaligned atomic: refused at post (EINVAL), QP still usable\n");
		} else {
			EXPECT_WC(a.cq, &wc, IBV_WC_REM_INV_REQ_ERR, -1);
			flushed_after("misaligned atomic: IBV_WC_REM_INV_REQ_ERR");
		}
		CHECK_RET(ibv_dereg_mr(ro), 0);
		CHECK_RET(ibv_dereg_mr(wo), 0);
		free(mem);
	}

	/* Keys of another PD (of the same NIC): refused as if they did not exist. */
	{
		struct ibv_context *c2 = open_dev("rb0");
		struct ibv_pd *pd2 = ibv_alloc_pd(c2);
		CHECK(pd2 != NULL);
		struct ibv_mr *mr2 = ibv_reg_mr(pd2, a.buf, 4096, ACC_ALL);
		CHECK(mr2 != NULL);
		struct ibv_pd *bpd2 = ibv_alloc_pd(b.ctx);
		CHECK(bpd2 != NULL);
		struct ibv_mr *bmr2 = ibv_reg_mr(bpd2, b.buf, 4096, ACC_ALL);
		CHECK(bmr2 != NULL);
		fresh(&o);
		post_recv(b.qp, 1, b.buf, 4096, b.mr->lkey);
		sge = (struct ibv_sge){(uintptr_t)a.buf, 16, mr2->lkey};
		w = (struct ibv_send_wr){.wr_id = 18, .sg_list = &sge, .num_sge = 1,
					 .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED};
		expect_fail(&w, IBV_WC_LOC_PROT_ERR);
		flushed_after("lkey of another context's PD: IBV_WC_LOC_PROT_ERR");
		fresh(&o);
		sge = (struct ibv_sge){(uintptr_t)a.buf, 16, a.mr->lkey};
		w = rdma_wr(19, IBV_WR_RDMA_WRITE, &sge, (uintptr_t)b.buf, bmr2->rkey);
		expect_fail(&w, IBV_WC_REM_ACCESS_ERR);
		flushed_after("rkey of another PD at the responder: IBV_WC_REM_ACCESS_ERR");
		CHECK_RET(ibv_dereg_mr(bmr2), 0);
		CHECK_RET(ibv_dealloc_pd(bpd2), 0);
		CHECK_RET(ibv_dereg_mr(mr2), 0);
		CHECK_RET(ibv_dealloc_pd(pd2), 0);
		CHECK_RET(ibv_close_device(c2), 0);
	}

	/* A receive too small: the receiver gets LOC_LEN_ERR, the sender REM_INV_REQ_ERR. */
	fresh(&o);
	post_recv(b.qp, 20, b.buf, 32, b.mr->lkey);
	sge = (struct ibv_sge){(uintptr_t)a.buf, 100, a.mr->lkey};
	w = (struct ibv_send_wr){.wr_id = 21, .sg_list = &sge, .num_sge = 1,
				 .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED};
	expect_fail(&w, IBV_WC_REM_INV_REQ_ERR);
	EXPECT_WC(b.cq, &wc, IBV_WC_LOC_LEN_ERR, -1);
	CHECK_EQ(wc.wr_id, 20);
	CHECK_EQ(wc.qp_num, b.qp->qp_num);
	CHECK_EQ(state_of(b.qp), IBV_QPS_ERR);
	flushed_after("receive too small: IBV_WC_LOC_LEN_ERR / IBV_WC_REM_INV_REQ_ERR");

	/* A receive with a bad lkey: the receiver gets LOC_PROT_ERR, the sender an error. */
	fresh(&o);
	post_recv(b.qp, 22, b.buf, 4096, b.mr->lkey ^ 0x7700);
	w.wr_id = 23;
	post(a.qp, &w);
	EXPECT_WC(b.cq, &wc, IBV_WC_LOC_PROT_ERR, -1);
	CHECK_EQ(wc.wr_id, 22);
	POLL_ONE(a.cq, &wc);
	CHECK_EQ(wc.wr_id, 23);
	CHECK(wc.status != IBV_WC_SUCCESS);
	printf("  receive with a bad lkey: IBV_WC_LOC_PROT_ERR at the receiver, %s at the "
	       "sender\n",
	       ibv_wc_status_str(wc.status));

	/* No receive posted and rnr_retry 0. */
	struct qp_opts rnr = o;
	rnr.rnr_retry = 0;
	fresh(&rnr);
	w.wr_id = 24;
	expect_fail(&w, IBV_WC_RNR_RETRY_EXC_ERR);
	flushed_after("no receive, rnr_retry 0: IBV_WC_RNR_RETRY_EXC_ERR");
	/* With rnr_retry 7 (for ever) a receive posted late is found. */
	fresh(&o);
	w.wr_id = 25;
	post(a.qp, &w);
	EXPECT_NO_WC(a.cq, 200);
	post_recv(b.qp, 26, b.buf, 4096, b.mr->lkey);
	EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 26);
	printf("  rnr_retry 7: a receive posted late is found\n");

	/* No responder QP: transport retries run out. */
	{
		struct qp_opts t = o;
		t.timeout = 1;
		t.retry_cnt = 1;
		fresh(&t);
		/* Point a's QP at a QP number nobody has. */
		CHECK_RET(ibv_destroy_qp(a.qp), 0);
		side_qp(&a, &t);
		qp_connect(a.qp, 0xfff0 ^ b.qp->qp_num, &b.gid, &t);
		w.wr_id = 27;
		expect_fail(&w, IBV_WC_RETRY_EXC_ERR);
		flushed_after("no responder QP: IBV_WC_RETRY_EXC_ERR");
	}

	/* The pair still works after all that. */
	fresh(&o);
	post_recv(b.qp, 30, b.buf, 4096, b.mr->lkey);
	fill(a.buf, 100, 3);
	w.wr_id = 31;
	post(a.qp, &w);
	EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_MEM(b.buf, a.buf, 100);

	drain(a.cq);
	drain(b.cq);
	side_close(&a);
	side_close(&b);
	printf("qp_errors: ok\n");
	return 0;
}
