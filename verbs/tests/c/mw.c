/* Memory windows (ibv_alloc_mw(3), ibv_bind_mw(3)): the device attributes that announce
 * them; type 1 windows bound with ibv_bind_mw (the window takes its next key) and type 2
 * windows bound with IBV_WR_BIND_MW, both through ibv_post_send and the ibv_wr_* builder;
 * peers writing and reading through a window, and only inside it; invalidation by
 * IBV_WR_LOCAL_INV and by a received IBV_WR_SEND_WITH_INV (IBV_WC_WITH_INV and
 * invalidated_rkey in the receive completion); EBUSY for a region with a bound window and
 * a PD with windows; EINVAL for what libibverbs and mlx5 refuse. */
#include "common.h"

static struct side a, b, c, d;

static void post(struct side *s, struct ibv_send_wr *wr)
{
	struct ibv_send_wr *bad = NULL;
	CHECK_RET(ibv_post_send(s->qp, wr, &bad), 0);
}

/* b writes `n` bytes of its buffer to `raddr` through `rkey`; the completion's status. */
static int b_write(uint64_t raddr, uint32_t rkey, uint32_t n)
{
	struct ibv_sge s = {.addr = (uintptr_t)b.buf, .length = n, .lkey = b.mr->lkey};
	struct ibv_send_wr wr = {
		.wr_id = 77,
		.sg_list = &s,
		.num_sge = 1,
		.opcode = IBV_WR_RDMA_WRITE,
		.send_flags = IBV_SEND_SIGNALED,
	};
	wr.wr.rdma.remote_addr = raddr;
	wr.wr.rdma.rkey = rkey;
	post(&b, &wr);
	struct ibv_wc wc;
	poll_one_at(__FILE__, __LINE__, b.cq, &wc);
	return wc.status;
}

int main(void)
{
	struct qp_opts o = default_qp_opts();
	pair_open(&a, &b, 0, 1 << 16, 64, &o);

	struct ibv_device_attr attr;
	CHECK_RET(ibv_query_device(a.ctx, &attr), 0);
	CHECK(attr.max_mw > 0);
	CHECK(attr.device_cap_flags & IBV_DEVICE_MEM_WINDOW);
	CHECK(attr.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B);

	/* ---- allocation ---- */
	CHECK_NULL_ERRNO(ibv_alloc_mw(a.pd, 3), EINVAL);
	struct ibv_mw *mw1 = ibv_alloc_mw(a.pd, IBV_MW_TYPE_1);
	struct ibv_mw *mw2 = ibv_alloc_mw(a.pd, IBV_MW_TYPE_2);
	CHECK(mw1 && mw2);
	CHECK(mw1->type == IBV_MW_TYPE_1 && mw2->type == IBV_MW_TYPE_2);
	CHECK(mw1->pd == a.pd && mw1->context == a.ctx);
	CHECK((mw1->rkey >> 8) != (mw2->rkey >> 8));
	/* A region windows may be bound to. */
	struct ibv_mr *mr = ibv_reg_mr(a.pd, a.buf, a.len, ACC_ALL | IBV_ACCESS_MW_BIND);
	CHECK(mr != NULL);
	uint8_t *win = a.buf + 4096;

	/* ---- type 1: ibv_bind_mw ---- */
	struct ibv_mw_bind bind = {
		.wr_id = 11,
		.send_flags = IBV_SEND_SIGNALED,
		.bind_info = {.mr = mr,
			      .addr = (uintptr_t)win,
			      .length = 256,
			      .mw_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ},
	};
	uint32_t old = mw1->rkey;
	CHECK_RET(ibv_bind_mw(a.qp, mw1, &bind), 0);
	CHECK_EQ(mw1->rkey, ibv_inc_rkey(old));
	struct ibv_wc wc;
	EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_BIND_MW);
	CHECK_EQ(wc.wr_id, 11);
	/* What libibverbs and the provider refuse before the device sees anything. */
	struct ibv_mw_bind zb = bind;
	zb.bind_info.mw_access_flags |= IBV_ACCESS_ZERO_BASED;
	CHECK_RET(ibv_bind_mw(a.qp, mw1, &zb), EINVAL);
	CHECK_RET(ibv_bind_mw(a.qp, mw2, &bind), EINVAL);
	struct ibv_mw_bind nomr = bind;
	nomr.bind_info.mr = NULL;
	CHECK_RET(ibv_bind_mw(a.qp, mw1, &nomr), EINVAL);
	/* b writes through the window, and reads it back. */
	fill(b.buf, 200, 9);
	CHECK_EQ(b_write((uintptr_t)win + 50, mw1->rkey, 200), IBV_WC_SUCCESS);
	CHECK_MEM(win + 50, b.buf, 200);
	/* The region is held by the window; the PD by both. */
	CHECK_RET(ibv_dereg_mr(mr), EBUSY);
	CHECK_RET(ibv_dealloc_pd(a.pd), EBUSY);
	/* Bound again with length 0: unbound, and the region is free. */
	struct ibv_mw_bind unbind = {.wr_id = 12, .send_flags = IBV_SEND_SIGNALED,
				     .bind_info = {.mr = mr}};
	CHECK_RET(ibv_bind_mw(a.qp, mw1, &unbind), 0);
	EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_BIND_MW);

	/* ---- type 2: IBV_WR_BIND_MW, then a SEND with invalidate from b ---- */
	uint32_t k2 = ibv_inc_rkey(mw2->rkey);
	struct ibv_send_wr bw = {.wr_id = 21, .opcode = IBV_WR_BIND_MW,
				 .send_flags = IBV_SEND_SIGNALED};
	bw.bind_mw.mw = mw2;
	bw.bind_mw.rkey = k2;
	bw.bind_mw.bind_info = bind.bind_info;
	post(&a, &bw);
	EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_BIND_MW);
	CHECK_EQ(wc.wr_id, 21);
	fill(b.buf, 64, 4);
	CHECK_EQ(b_write((uintptr_t)win, k2, 64), IBV_WC_SUCCESS);
	CHECK_MEM(win, b.buf, 64);
	struct ibv_sge rs = {.addr = (uintptr_t)a.buf + 8192, .length = 64, .lkey = a.mr->lkey};
	struct ibv_recv_wr rw = {.wr_id = 31, .sg_list = &rs, .num_sge = 1}, *rbad = NULL;
	CHECK_RET(ibv_post_recv(a.qp, &rw, &rbad), 0);
	struct ibv_sge ss = {.addr = (uintptr_t)b.buf, .length = 16, .lkey = b.mr->lkey};
	struct ibv_send_wr iw = {.wr_id = 32, .sg_list = &ss, .num_sge = 1,
				 .opcode = IBV_WR_SEND_WITH_INV, .send_flags = IBV_SEND_SIGNALED};
	iw.invalidate_rkey = k2;
	post(&b, &iw);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.byte_len, 16);
	CHECK(wc.wc_flags & IBV_WC_WITH_INV);
	CHECK(!(wc.wc_flags & IBV_WC_WITH_IMM));
	CHECK_EQ(wc.invalidated_rkey, k2);

	/* Bound again under another key, then invalidated locally. */
	uint32_t k3 = ibv_inc_rkey(k2);
	bw.bind_mw.rkey = k3;
	post(&a, &bw);
	EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_BIND_MW);
	CHECK_EQ(b_write((uintptr_t)win, k3, 8), IBV_WC_SUCCESS);
	struct ibv_send_wr lw = {.wr_id = 41, .opcode = IBV_WR_LOCAL_INV,
				 .send_flags = IBV_SEND_SIGNALED};
	lw.invalidate_rkey = k3;
	post(&a, &lw);
	EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_LOCAL_INV);
	CHECK_EQ(wc.wr_id, 41);
	/* A request naming something that is not a window is refused at the post. */
	bw.bind_mw.mw = (struct ibv_mw *)a.mr;
	struct ibv_send_wr *bad = NULL;
	CHECK_RET(ibv_post_send(a.qp, &bw, &bad), EINVAL);
	CHECK(bad == &bw);
	bw.bind_mw.mw = mw2;

	/* ---- the ibv_wr_* builder, on a second pair with the extended API ---- */
	struct qp_opts ox = default_qp_opts();
	ox.ex = 1;
	ox.more_send_ops = IBV_QP_EX_WITH_BIND_MW | IBV_QP_EX_WITH_LOCAL_INV |
			   IBV_QP_EX_WITH_SEND_WITH_INV;
	pair_open(&c, &d, 0, 1 << 16, 64, &ox);
	struct ibv_mr *cmr = ibv_reg_mr(c.pd, c.buf, c.len, ACC_ALL | IBV_ACCESS_MW_BIND);
	struct ibv_mw *cmw = ibv_alloc_mw(c.pd, IBV_MW_TYPE_2);
	CHECK(cmr && cmw);
	struct ibv_qp_ex *cx = ibv_qp_to_qp_ex(c.qp), *dx = ibv_qp_to_qp_ex(d.qp);
	CHECK(cx && dx);
	uint32_t kc = ibv_inc_rkey(cmw->rkey);
	struct ibv_mw_bind_info ci = {.mr = cmr, .addr = (uintptr_t)c.buf, .length = 128,
				      .mw_access_flags = IBV_ACCESS_REMOTE_WRITE};
	ibv_wr_start(cx);
	cx->wr_id = 51;
	cx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_bind_mw(cx, cmw, kc, &ci);
	CHECK_RET(ibv_wr_complete(cx), 0);
	EXPECT_WC(c.cq, &wc, IBV_WC_SUCCESS, IBV_WC_BIND_MW);
	/* d invalidates it with a SEND built the same way. */
	struct ibv_sge crs = {.addr = (uintptr_t)c.buf + 4096, .length = 64, .lkey = c.mr->lkey};
	struct ibv_recv_wr crw = {.wr_id = 52, .sg_list = &crs, .num_sge = 1};
	CHECK_RET(ibv_post_recv(c.qp, &crw, &rbad), 0);
	ibv_wr_start(dx);
	dx->wr_id = 53;
	dx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send_inv(dx, kc);
	ibv_wr_set_sge(dx, d.mr->lkey, (uintptr_t)d.buf, 8);
	CHECK_RET(ibv_wr_complete(dx), 0);
	EXPECT_WC(d.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	EXPECT_WC(c.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK(wc.wc_flags & IBV_WC_WITH_INV);
	CHECK_EQ(wc.invalidated_rkey, kc);
	/* Bound once more, then LOCAL_INV through the builder. */
	ibv_wr_start(cx);
	cx->wr_id = 54;
	ibv_wr_bind_mw(cx, cmw, ibv_inc_rkey(kc), &ci);
	cx->wr_id = 55;
	ibv_wr_local_inv(cx, ibv_inc_rkey(kc));
	CHECK_RET(ibv_wr_complete(cx), 0);
	EXPECT_WC(c.cq, &wc, IBV_WC_SUCCESS, IBV_WC_BIND_MW);
	EXPECT_WC(c.cq, &wc, IBV_WC_SUCCESS, IBV_WC_LOCAL_INV);
	CHECK_EQ(wc.wr_id, 55);
	CHECK_RET(ibv_dealloc_mw(cmw), 0);
	CHECK_RET(ibv_dereg_mr(cmr), 0);

	/* ---- last, since it takes b's QP to the error state: an invalidated key ---- */
	CHECK_EQ(b_write((uintptr_t)win, k3, 8), IBV_WC_REM_ACCESS_ERR);

	CHECK_RET(ibv_dealloc_mw(mw1), 0);
	CHECK_RET(ibv_dealloc_mw(mw2), 0);
	CHECK_RET(ibv_dereg_mr(mr), 0);
	side_close(&c);
	side_close(&d);
	side_close(&a);
	side_close(&b);
	printf("memory windows: every check passed\n");
	return 0;
}
