/* XRC (ibv_open_xrcd(3), ibv_create_srq_ex with IBV_SRQT_XRC, IBV_QPT_XRC_SEND and
 * IBV_QPT_XRC_RECV): domains opened by file (shared per inode, O_CREAT and O_EXCL as the
 * kernel has them) or on their own; XRC SRQs with their own CQ and ibv_get_srq_num; an
 * initiator on rb1 connected to one target on rb0 reaching both SRQs of the target's
 * domain, through ibv_post_send (wr.qp_type.xrc.remote_srqn) and the ibv_wr_* builder
 * (ibv_wr_set_xrc_srqn), with RC's modify masks (the kernel drops what a side lacks); what
 * is refused (errnos), and a domain busy while an SRQ or target uses it. */
#include "common.h"
#include <fcntl.h>

static struct side a, b;

static struct ibv_srq *xrc_srq(struct ibv_xrcd *x, struct ibv_cq *cq)
{
	struct ibv_srq_init_attr_ex sa = {
		.attr = {.max_wr = 16, .max_sge = 1},
		.comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD | IBV_SRQ_INIT_ATTR_CQ |
			     IBV_SRQ_INIT_ATTR_XRCD,
		.srq_type = IBV_SRQT_XRC,
		.pd = a.pd,
		.xrcd = x,
		.cq = cq,
	};
	return ibv_create_srq_ex(a.ctx, &sa);
}

int main(void)
{
	struct qp_opts o = default_qp_opts();
	side_open(&a, "rb0", 1 << 16, 64);
	side_open(&b, "rb1", 1 << 16, 64);

	struct ibv_device_attr da;
	CHECK_RET(ibv_query_device(a.ctx, &da), 0);
	CHECK(da.device_cap_flags & IBV_DEVICE_XRC);

	/* ---- domains ---- */
	char path[] = "/tmp/ringbell-xrcd-XXXXXX";
	int fd = mkstemp(path);
	CHECK(fd >= 0);
	unlink(path);
	struct ibv_xrcd_init_attr xa = {.comp_mask = IBV_XRCD_INIT_ATTR_FD, .fd = fd,
					.oflags = O_CREAT};
	CHECK_NULL_ERRNO(ibv_open_xrcd(a.ctx, &xa), EINVAL);
	xa.comp_mask = IBV_XRCD_INIT_ATTR_FD | IBV_XRCD_INIT_ATTR_OFLAGS | IBV_XRCD_INIT_ATTR_RESERVED;
	CHECK_NULL_ERRNO(ibv_open_xrcd(a.ctx, &xa), EOPNOTSUPP);
	xa.comp_mask = IBV_XRCD_INIT_ATTR_FD | IBV_XRCD_INIT_ATTR_OFLAGS;
	xa.oflags = 0;
	/* No domain for this file yet, and no O_CREAT. */
	CHECK_NULL_ERRNO(ibv_open_xrcd(a.ctx, &xa), EINVAL);
	xa.oflags = O_CREAT;
	struct ibv_xrcd *x1 = ibv_open_xrcd(a.ctx, &xa);
	CHECK(x1 != NULL && x1->context == a.ctx);
	/* The same file again: the same domain; with O_EXCL refused. */
	xa.oflags = 0;
	struct ibv_xrcd *x2 = ibv_open_xrcd(a.ctx, &xa);
	CHECK(x2 != NULL && x2 != x1);
	xa.oflags = O_CREAT | O_EXCL;
	CHECK_NULL_ERRNO(ibv_open_xrcd(a.ctx, &xa), EINVAL);
	xa.fd = -1;
	xa.oflags = O_CREAT;
	struct ibv_xrcd *lone = ibv_open_xrcd(a.ctx, &xa);
	CHECK(lone != NULL);

	/* ---- SRQs and QPs ---- */
	struct ibv_cq *cq0 = ibv_create_cq(a.ctx, 16, NULL, NULL, 0);
	struct ibv_cq *cq1 = ibv_create_cq(a.ctx, 16, NULL, NULL, 0);
	CHECK(cq0 != NULL && cq1 != NULL);
	struct ibv_srq_init_attr_ex bad = {
		.attr = {.max_wr = 4, .max_sge = 1},
		.comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD | IBV_SRQ_INIT_ATTR_XRCD,
		.srq_type = IBV_SRQT_XRC,
		.pd = a.pd,
		.xrcd = x1,
	};
	CHECK_NULL_ERRNO(ibv_create_srq_ex(a.ctx, &bad), EINVAL); /* no CQ */
	struct ibv_srq *s0 = xrc_srq(x1, cq0);
	struct ibv_srq *s1 = xrc_srq(x2, cq1); /* through the other handle: the same domain */
	struct ibv_srq *alien = xrc_srq(lone, cq1);
	CHECK(s0 != NULL && s1 != NULL && alien != NULL);
	uint32_t n0, n1, nalien;
	CHECK_RET(ibv_get_srq_num(s0, &n0), 0);
	CHECK_RET(ibv_get_srq_num(s1, &n1), 0);
	CHECK_RET(ibv_get_srq_num(alien, &nalien), 0);
	CHECK(n0 != n1);

	struct ibv_qp_init_attr_ex ta = {.qp_type = IBV_QPT_XRC_RECV,
					 .comp_mask = IBV_QP_INIT_ATTR_XRCD, .xrcd = x2};
	struct ibv_qp *tgt = ibv_create_qp_ex(a.ctx, &ta);
	CHECK(tgt != NULL);
	CHECK(tgt->pd == NULL && tgt->send_cq == NULL && tgt->srq == NULL);
	ta.comp_mask = 0;
	CHECK_NULL_ERRNO(ibv_create_qp_ex(a.ctx, &ta), EINVAL); /* no XRCD */
	/* The initiator: no receive CQ needed (the legacy call, as ibv_create_qp_ex with only
	 * a PD passes it on). */
	struct ibv_qp_init_attr ia = {.send_cq = b.cq, .qp_type = IBV_QPT_XRC_SEND,
				      .cap = {.max_send_wr = 16, .max_send_sge = 1}};
	struct ibv_qp *ini = ibv_create_qp(b.pd, &ia);
	CHECK(ini != NULL);
	/* An initiator with an SRQ has a receive side it cannot have. */
	ia.srq = s0;
	CHECK_NULL_ERRNO(ibv_create_qp(b.pd, &ia), EINVAL);
	/* Both sides with RC's masks (qp_connect passes every RC attribute). */
	qp_connect(tgt, ini->qp_num, &b.gid, &o);
	qp_connect(ini, tgt->qp_num, &a.gid, &o);
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qi;
	CHECK_RET(ibv_query_qp(tgt, &qa, IBV_QP_STATE, &qi), 0);
	CHECK_EQ(qa.qp_state, IBV_QPS_RTS);

	/* ---- traffic ---- */
	post_srq_recv(s0, 100, a.buf, 1024, a.mr->lkey);
	post_srq_recv(s1, 101, a.buf + 1024, 1024, a.mr->lkey);
	fill(b.buf, 2048, 5);
	struct ibv_sge sg = {(uintptr_t)b.buf, 700, b.mr->lkey};
	struct ibv_send_wr w = {.wr_id = 1, .sg_list = &sg, .num_sge = 1, .opcode = IBV_WR_SEND,
				.send_flags = IBV_SEND_SIGNALED};
	w.qp_type.xrc.remote_srqn = n1;
	struct ibv_send_wr *badwr = NULL;
	CHECK_RET(ibv_post_send(ini, &w, &badwr), 0);
	struct ibv_wc wc;
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	EXPECT_WC(cq1, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 101);
	CHECK_EQ(wc.byte_len, 700);
	CHECK_EQ(wc.qp_num, tgt->qp_num);
	CHECK_MEM(a.buf + 1024, b.buf, 700);
	EXPECT_NO_WC(cq0, 10);
	/* No receive queue on either side. */
	struct ibv_sge rs = {(uintptr_t)b.buf, 64, b.mr->lkey};
	struct ibv_recv_wr rw = {.wr_id = 3, .sg_list = &rs, .num_sge = 1};
	struct ibv_recv_wr *badr = NULL;
	CHECK(ibv_post_recv(ini, &rw, &badr) != 0);
	CHECK(ibv_post_recv(tgt, &rw, &badr) != 0);

	/* The builder, on an initiator made with send ops: SEND with immediate to s0. */
	struct ibv_qp_init_attr_ex ix = {.send_cq = b.cq, .qp_type = IBV_QPT_XRC_SEND,
					 .cap = {.max_send_wr = 8, .max_send_sge = 1},
					 .comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
					 .pd = b.pd,
					 .send_ops_flags = IBV_QP_EX_WITH_SEND_WITH_IMM};
	struct ibv_qp *ini2 = ibv_create_qp_ex(b.ctx, &ix);
	CHECK(ini2 != NULL);
	struct ibv_qp_init_attr_ex ta2 = {.qp_type = IBV_QPT_XRC_RECV,
					  .comp_mask = IBV_QP_INIT_ATTR_XRCD, .xrcd = x1};
	struct ibv_qp *tgt2 = ibv_create_qp_ex(a.ctx, &ta2);
	CHECK(tgt2 != NULL);
	qp_connect(tgt2, ini2->qp_num, &b.gid, &o);
	qp_connect(ini2, tgt2->qp_num, &a.gid, &o);
	struct ibv_qp_ex *qx = ibv_qp_to_qp_ex(ini2);
	CHECK(qx != NULL);
	ibv_wr_start(qx);
	qx->wr_id = 2;
	qx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send_imm(qx, htonl(0x1234));
	ibv_wr_set_xrc_srqn(qx, n0);
	ibv_wr_set_sge(qx, b.mr->lkey, (uintptr_t)b.buf + 1000, 48);
	CHECK_RET(ibv_wr_complete(qx), 0);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	EXPECT_WC(cq0, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 100);
	CHECK(wc.wc_flags & IBV_WC_WITH_IMM);
	CHECK_EQ(ntohl(wc.imm_data), 0x1234);
	CHECK_EQ(wc.qp_num, tgt2->qp_num);
	CHECK_MEM(a.buf, b.buf + 1000, 48);

	/* A request naming an SRQ of another domain is invalid: both QPs go to ERR. */
	post_srq_recv(alien, 102, a.buf + 4096, 1024, a.mr->lkey);
	w.wr_id = 4;
	w.qp_type.xrc.remote_srqn = nalien;
	CHECK_RET(ibv_post_send(ini, &w, &badwr), 0);
	EXPECT_WC(b.cq, &wc, IBV_WC_REM_INV_REQ_ERR, -1);
	EXPECT_NO_WC(cq1, 10);

	/* ---- busy domains, then teardown ---- */
	CHECK_RET(ibv_close_xrcd(x1), EBUSY);
	CHECK_RET(ibv_destroy_qp(tgt2), 0);
	CHECK_RET(ibv_destroy_srq(s0), 0);
	CHECK_RET(ibv_close_xrcd(x1), 0);
	CHECK_RET(ibv_close_xrcd(x2), EBUSY);
	CHECK_RET(ibv_destroy_qp(tgt), 0);
	CHECK_RET(ibv_destroy_srq(s1), 0);
	CHECK_RET(ibv_close_xrcd(x2), 0);
	CHECK_RET(ibv_destroy_srq(alien), 0);
	CHECK_RET(ibv_close_xrcd(lone), 0);
	CHECK_RET(ibv_destroy_qp(ini), 0);
	CHECK_RET(ibv_destroy_qp(ini2), 0);
	CHECK_RET(ibv_destroy_cq(cq0), 0);
	CHECK_RET(ibv_destroy_cq(cq1), 0);
	close(fd);
	side_close(&a);
	side_close(&b);
	printf("  xrc: domains, XRC SRQs, initiator and target, both posting paths\n");
	return 0;
}
