/* Unreliable datagrams: UD QPs (creation caps, the UD state table and its masks, the Q_Key
 * in ibv_query_qp), address handles (ibv_create_ah with its bad inputs, the PD check at
 * post time, ibv_destroy_ah), and traffic between rb0 and rb1 and between two contexts of
 * rb0: the GRH area at the head of the receive buffer, src_qp and IBV_WC_GRH in the
 * completion (classic and extended CQ), the reply through ibv_create_ah_from_wc and
 * ibv_init_ah_from_wc, SEND_WITH_IMM, inline sends, a wrong Q_Key dropped, a Q_Key with bit
 * 31 (the QP's own), RC opcodes refused with bad_wr, and the ibv_wr_* builder with
 * ibv_wr_set_ud_addr. */
#include "common.h"
#include <netinet/ip.h>

#define QKEY 0x11111111u
#define GRH 40
#define BUF 65536

struct ud {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	struct ibv_mr *mr;
	uint8_t *buf;
	union ibv_gid gid;
};

/* A zeroed buffer of whole pages (a page registered on one NIC is not shared with a
 * buffer registered on the other). */
static uint8_t *page_buf(void)
{
	uint8_t *p = aligned_alloc(4096, BUF);
	CHECK(p != NULL);
	memset(p, 0, BUF);
	return p;
}

/* RESET -> INIT -> RTR -> RTS with Q_Key `qkey`, as every UD program does. */
static void ud_ready(struct ibv_qp *qp, uint32_t qkey, uint32_t sq_psn)
{
	struct ibv_qp_attr a = {
		.qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = 1, .qkey = qkey};
	CHECK_RET(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
						IBV_QP_QKEY),
		  0);
	a.qp_state = IBV_QPS_RTR;
	CHECK_RET(ibv_modify_qp(qp, &a, IBV_QP_STATE), 0);
	a.qp_state = IBV_QPS_RTS;
	a.sq_psn = sq_psn;
	CHECK_RET(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN), 0);
	CHECK_EQ(qp->state, IBV_QPS_RTS);
}

static struct ibv_qp *ud_create(struct ud *u, uint32_t max_inline)
{
	struct ibv_qp_init_attr ia = {
		.send_cq = u->cq,
		.recv_cq = u->cq,
		.cap = {.max_send_wr = 32, .max_recv_wr = 32, .max_send_sge = 2,
			.max_recv_sge = 2, .max_inline_data = max_inline},
		.qp_type = IBV_QPT_UD,
		.sq_sig_all = 1,
	};
	struct ibv_qp *qp = ibv_create_qp(u->pd, &ia);
	CHECK(qp != NULL);
	CHECK(ia.cap.max_inline_data >= max_inline);
	return qp;
}

static void ud_open(struct ud *u, const char *dev)
{
	memset(u, 0, sizeof(*u));
	u->ctx = open_dev(dev);
	u->gid = gid_of(u->ctx);
	u->pd = ibv_alloc_pd(u->ctx);
	CHECK(u->pd != NULL);
	u->cq = ibv_create_cq(u->ctx, 256, NULL, NULL, 0);
	CHECK(u->cq != NULL);
	u->buf = page_buf();
	u->mr = ibv_reg_mr(u->pd, u->buf, BUF, IBV_ACCESS_LOCAL_WRITE);
	CHECK(u->mr != NULL);
	u->qp = ud_create(u, 204);
	ud_ready(u->qp, QKEY, 0x42);
}

static void ud_close(struct ud *u)
{
	CHECK_RET(ibv_destroy_qp(u->qp), 0);
	CHECK_RET(ibv_dereg_mr(u->mr), 0);
	CHECK_RET(ibv_destroy_cq(u->cq), 0);
	CHECK_RET(ibv_dealloc_pd(u->pd), 0);
	CHECK_RET(ibv_close_device(u->ctx), 0);
	free(u->buf);
}

static struct ibv_ah *ah_to(struct ibv_pd *pd, const union ibv_gid *gid)
{
	struct ibv_ah_attr aa = {.is_global = 1, .port_num = 1};
	aa.grh.dgid = *gid;
	aa.grh.hop_limit = 64;
	struct ibv_ah *ah = ibv_create_ah(pd, &aa);
	CHECK(ah != NULL);
	CHECK(ah->pd == pd);
	CHECK(ah->context == pd->context);
	return ah;
}

/* A UD SEND of `len` bytes at `off` of u's buffer to (ah, qpn, qkey). */
static struct ibv_send_wr ud_wr(struct ibv_sge *sge, uint64_t id, enum ibv_wr_opcode op,
				struct ibv_ah *ah, uint32_t qpn, uint32_t qkey)
{
	struct ibv_send_wr w = {.wr_id = id, .sg_list = sge, .num_sge = 1, .opcode = op};
	w.wr.ud.ah = ah;
	w.wr.ud.remote_qpn = qpn;
	w.wr.ud.remote_qkey = qkey;
	return w;
}

static void send_ud(struct ud *u, uint64_t id, size_t off, uint32_t len, struct ibv_ah *ah,
		    uint32_t qpn, uint32_t qkey)
{
	struct ibv_sge sge = {(uintptr_t)u->buf + off, len, u->mr->lkey};
	struct ibv_send_wr w = ud_wr(&sge, id, IBV_WR_SEND, ah, qpn, qkey), *bad = NULL;
	CHECK_RET(ibv_post_send(u->qp, &w, &bad), 0);
}

static void sent(struct ud *u, uint64_t id)
{
	struct ibv_wc wc;
	EXPECT_WC(u->cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	CHECK_EQ(wc.wr_id, id);
	CHECK_EQ(wc.qp_num, u->qp->qp_num);
}

/* The receive completion of a datagram from `from` into u's buffer at `off`. */
static void received(struct ud *u, struct ibv_wc *wc, uint64_t id, uint32_t len,
		     uint32_t from_qpn)
{
	EXPECT_WC(u->cq, wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc->wr_id, id);
	CHECK_EQ(wc->byte_len, GRH + len);
	CHECK_EQ(wc->qp_num, u->qp->qp_num);
	CHECK_EQ(wc->src_qp, from_qpn);
	CHECK(wc->wc_flags & IBV_WC_GRH);
	CHECK_EQ(wc->slid, 0);
	/* Not a service level on RoCE: the frame type, as ConnectX reports it (bit 3 UDP,
	 * L3 type 2 IPv4), which datagram receivers such as UCX's ud_verbs read. */
	CHECK_EQ(wc->sl, 0xa);
	CHECK_EQ(wc->pkey_index, 0);
	CHECK_EQ(wc->dlid_path_bits, 0);
}

/* The GRH area of a RoCEv2-over-IPv4 datagram: 20 zero bytes, then the IPv4 header. */
static void check_grh(const uint8_t *p, const union ibv_gid *src, const union ibv_gid *dst)
{
	for (int i = 0; i < 20; i++)
		CHECK_EQ(p[i], 0);
	const struct iphdr *ip = (const void *)(p + 20);
	CHECK_EQ(ip->version, 4);
	CHECK_EQ(ip->ihl, 5);
	CHECK_EQ(ip->protocol, IPPROTO_UDP);
	CHECK_MEM(&ip->saddr, src->raw + 12, 4);
	CHECK_MEM(&ip->daddr, dst->raw + 12, 4);
}

static void creation(void)
{
	struct ud u;
	ud_open(&u, "rb0");
	CHECK_EQ(u.qp->qp_type, IBV_QPT_UD);

	struct ibv_qp_init_attr ia = {
		.send_cq = u.cq,
		.recv_cq = u.cq,
		.cap = {.max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1},
		.qp_type = IBV_QPT_UD,
	};
	/* A UD WQE holds at most 204 inline bytes and 13 gather entries. */
	ia.cap.max_inline_data = 205;
	CHECK_NULL_ERRNO(ibv_create_qp(u.pd, &ia), EINVAL);
	ia.cap.max_inline_data = 0;
	ia.cap.max_send_sge = 14;
	CHECK_NULL_ERRNO(ibv_create_qp(u.pd, &ia), EINVAL);
	ia.cap.max_send_sge = 13;
	struct ibv_qp *q = ibv_create_qp(u.pd, &ia);
	CHECK(q != NULL);
	CHECK_EQ(ia.cap.max_send_sge, 13);
	CHECK_EQ(q->state, IBV_QPS_RESET);

	/* The UD state table: RESET -> INIT needs PKEY_INDEX | PORT | QKEY, and takes no
	 * access flags; INIT -> RTR nothing more; RTR -> RTS needs SQ_PSN. */
	struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .port_num = 1, .qkey = 0x123};
	CHECK_RET(ibv_modify_qp(q, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT), EINVAL);
	CHECK_RET(ibv_modify_qp(q, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
					       IBV_QP_QKEY | IBV_QP_ACCESS_FLAGS),
		  EINVAL);
	CHECK_EQ(q->state, IBV_QPS_RESET);
	CHECK_RET(ibv_modify_qp(q, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
					       IBV_QP_QKEY),
		  0);
	CHECK_EQ(q->state, IBV_QPS_INIT);
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qi;
	CHECK_RET(ibv_query_qp(q, &qa, IBV_QP_QKEY | IBV_QP_STATE | IBV_QP_CAP, &qi), 0);
	CHECK_EQ(qa.qkey, 0x123);
	CHECK_EQ(qa.qp_state, IBV_QPS_INIT);
	CHECK_EQ(qi.qp_type, IBV_QPT_UD);
	CHECK_EQ(qi.cap.max_send_sge, 13);
	/* An RC attribute on the way to RTR. */
	a.qp_state = IBV_QPS_RTR;
	a.dest_qp_num = 5;
	CHECK_RET(ibv_modify_qp(q, &a, IBV_QP_STATE | IBV_QP_DEST_QPN), EINVAL);
	CHECK_RET(ibv_modify_qp(q, &a, IBV_QP_STATE), 0);
	a.qp_state = IBV_QPS_RTS;
	a.sq_psn = 0x45;
	CHECK_RET(ibv_modify_qp(q, &a, IBV_QP_STATE), EINVAL);
	CHECK_RET(ibv_modify_qp(q, &a, IBV_QP_STATE | IBV_QP_SQ_PSN), 0);
	/* The Q_Key may change in RTS. */
	a.qkey = 0x456;
	CHECK_RET(ibv_modify_qp(q, &a, IBV_QP_QKEY), 0);
	CHECK_RET(ibv_query_qp(q, &qa, IBV_QP_QKEY | IBV_QP_SQ_PSN, &qi), 0);
	CHECK_EQ(qa.qkey, 0x456);
	CHECK_EQ(qa.sq_psn, 0x45);
	CHECK_EQ(qa.qp_state, IBV_QPS_RTS);
	a.qp_state = IBV_QPS_RESET;
	CHECK_RET(ibv_modify_qp(q, &a, IBV_QP_STATE), 0);
	CHECK_EQ(q->state, IBV_QPS_RESET);
	CHECK_RET(ibv_destroy_qp(q), 0);

	/* The receive queue takes exactly what the caps report (the ring's size): one more
	 * is ENOMEM. Nothing is received in RESET. */
	ia.cap.max_send_sge = 1;
	ia.cap.max_recv_wr = 5;
	q = ibv_create_qp(u.pd, &ia);
	CHECK(q != NULL);
	CHECK(ia.cap.max_recv_wr >= 5);
	struct ibv_sge rs = {(uintptr_t)u.buf, 64, u.mr->lkey};
	struct ibv_recv_wr rw = {.wr_id = 1, .sg_list = &rs, .num_sge = 1}, *rbad = NULL;
	CHECK_RET(ibv_post_recv(q, &rw, &rbad), EINVAL);
	CHECK(rbad == &rw);
	ud_ready(q, QKEY, 0);
	for (uint32_t i = 0; i < ia.cap.max_recv_wr; i++)
		CHECK_RET(ibv_post_recv(q, &rw, &rbad), 0);
	rbad = NULL;
	CHECK_RET(ibv_post_recv(q, &rw, &rbad), ENOMEM);
	CHECK(rbad == &rw);
	/* More scatter entries than the QP has. */
	struct ibv_recv_wr rw2 = {.wr_id = 2, .sg_list = &rs, .num_sge = 2};
	CHECK_RET(ibv_post_recv(q, &rw2, &rbad), EINVAL);
	CHECK_RET(ibv_destroy_qp(q), 0);

	/* Extended creation: a UD QP builds SEND and SEND_WITH_IMM only. */
	struct ibv_qp_init_attr_ex ax = {
		.send_cq = u.cq,
		.recv_cq = u.cq,
		.cap = ia.cap,
		.qp_type = IBV_QPT_UD,
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
		.pd = u.pd,
		.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_RDMA_WRITE,
	};
	CHECK_NULL_ERRNO(ibv_create_qp_ex(u.ctx, &ax), EOPNOTSUPP);
	ax.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM;
	q = ibv_create_qp_ex(u.ctx, &ax);
	CHECK(q != NULL);
	CHECK_EQ(q->qp_type, IBV_QPT_UD);
	CHECK(ibv_qp_to_qp_ex(q) != NULL);
	CHECK_RET(ibv_destroy_qp(q), 0);
	/* Without send ops flags, through ibv_create_qp. */
	ax.comp_mask = IBV_QP_INIT_ATTR_PD;
	q = ibv_create_qp_ex(u.ctx, &ax);
	CHECK(q != NULL);
	CHECK_RET(ibv_destroy_qp(q), 0);
	ud_close(&u);
	printf("  creation: caps, the UD state table, Q_Key in ibv_query_qp\n");
}

static void address_handles(void)
{
	struct ud u;
	ud_open(&u, "rb0");
	union ibv_gid rb1 = u.gid;
	rb1.raw[15] = 2; /* ::ffff:10.0.0.2, rb1 */
	struct ibv_ah_attr aa = {.is_global = 1, .port_num = 1};
	aa.grh.dgid = rb1;
	CHECK_NULL_ERRNO(ibv_create_ah(u.pd, NULL), EINVAL);
	/* RoCE needs the GRH. */
	aa.is_global = 0;
	CHECK_NULL_ERRNO(ibv_create_ah(u.pd, &aa), EINVAL);
	aa.is_global = 1;
	/* No port 2, no GID index 1 (an empty entry). */
	aa.port_num = 2;
	CHECK_NULL_ERRNO(ibv_create_ah(u.pd, &aa), EINVAL);
	aa.port_num = 1;
	aa.grh.sgid_index = 1;
	CHECK_NULL_ERRNO(ibv_create_ah(u.pd, &aa), EINVAL);
	aa.grh.sgid_index = 0;
	/* GIDs that name no port of the fabric. */
	union ibv_gid g = {.raw = {0xfe, 0x80}};
	aa.grh.dgid = g;
	CHECK_NULL_ERRNO(ibv_create_ah(u.pd, &aa), EINVAL);
	g = rb1;
	g.raw[12] = 192;
	g.raw[13] = 168;
	aa.grh.dgid = g;
	CHECK_NULL_ERRNO(ibv_create_ah(u.pd, &aa), EINVAL);
	memset(&g, 0, sizeof(g));
	aa.grh.dgid = g;
	CHECK_NULL_ERRNO(ibv_create_ah(u.pd, &aa), EINVAL);
	/* A dead PD. */
	struct ibv_pd *pd2 = ibv_alloc_pd(u.ctx);
	CHECK(pd2 != NULL);
	CHECK_RET(ibv_dealloc_pd(pd2), 0);
	aa.grh.dgid = rb1;
	CHECK_NULL_ERRNO(ibv_create_ah(pd2, &aa), EINVAL);

	struct ibv_ah *ah = ah_to(u.pd, &rb1);
	struct ibv_ah *self = ah_to(u.pd, &u.gid);
	/* The PD has children now. */
	CHECK_RET(ibv_dealloc_pd(u.pd), EBUSY);
	CHECK_RET(ibv_destroy_ah(ah), 0);
	CHECK_RET(ibv_destroy_ah(ah), EINVAL);
	CHECK_RET(ibv_destroy_ah(NULL), EINVAL);
	/* A destroyed AH in a work request. */
	struct ibv_sge sge = {(uintptr_t)u.buf, 8, u.mr->lkey};
	struct ibv_send_wr w = ud_wr(&sge, 1, IBV_WR_SEND, ah, 2, QKEY), *bad = NULL;
	CHECK_RET(ibv_post_send(u.qp, &w, &bad), EINVAL);
	CHECK(bad == &w);
	w.wr.ud.ah = NULL;
	bad = NULL;
	CHECK_RET(ibv_post_send(u.qp, &w, &bad), EINVAL);
	CHECK(bad == &w);
	EXPECT_NO_WC(u.cq, 20);
	CHECK_RET(ibv_destroy_ah(self), 0);
	/* An AH the program leaves is released with its context. */
	ah_to(u.pd, &rb1);
	CHECK_RET(ibv_destroy_qp(u.qp), 0);
	CHECK_RET(ibv_dereg_mr(u.mr), 0);
	CHECK_RET(ibv_destroy_cq(u.cq), 0);
	CHECK_RET(ibv_close_device(u.ctx), 0);
	free(u.buf);
	printf("  address handles: bad attributes, dead handles, PD in use, released on close\n");
}

/* Datagrams between `a` and `b` (rb0 and rb1, or two contexts of one NIC). */
static void traffic(struct ud *a, struct ud *b, const char *what)
{
	struct ibv_wc wc;
	struct ibv_ah *to_b = ah_to(a->pd, &b->gid);

	/* A SEND of 1000 bytes lands after the 40-byte GRH area. */
	fill(a->buf, 1000, 1);
	post_recv(b->qp, 100, b->buf, GRH + 2048, b->mr->lkey);
	send_ud(a, 1, 0, 1000, to_b, b->qp->qp_num, QKEY);
	sent(a, 1);
	received(b, &wc, 100, 1000, a->qp->qp_num);
	CHECK_EQ(wc.wc_flags & IBV_WC_WITH_IMM, 0);
	CHECK_MEM(b->buf + GRH, a->buf, 1000);
	check_grh(b->buf, &a->gid, &b->gid);

	/* The reply goes back through an AH made from the completion and the GRH. */
	struct ibv_ah_attr from;
	CHECK_OK(ibv_init_ah_from_wc(b->ctx, 1, &wc, (struct ibv_grh *)b->buf, &from));
	CHECK_EQ(from.is_global, 1);
	CHECK_EQ(from.port_num, 1);
	CHECK_EQ(from.grh.sgid_index, 0);
	CHECK_MEM(from.grh.dgid.raw, a->gid.raw, 16);
	struct ibv_ah *back = ibv_create_ah_from_wc(b->pd, &wc, (struct ibv_grh *)b->buf, 1);
	CHECK(back != NULL);
	CHECK(back->pd == b->pd);
	fill(b->buf + 8192, 300, 2);
	post_recv(a->qp, 200, a->buf + 16384, GRH + 300, a->mr->lkey);
	send_ud(b, 2, 8192, 300, back, wc.src_qp, QKEY);
	sent(b, 2);
	received(a, &wc, 200, 300, b->qp->qp_num);
	CHECK_MEM(a->buf + 16384 + GRH, b->buf + 8192, 300);
	CHECK_RET(ibv_destroy_ah(back), 0);
	/* Without IBV_WC_GRH there is no GRH to build from: the AH would have no GRH, which
	 * RoCE refuses. */
	wc.wc_flags &= ~IBV_WC_GRH;
	CHECK_NULL_ERRNO(ibv_create_ah_from_wc(b->pd, &wc, (struct ibv_grh *)b->buf, 1), EINVAL);

	/* SEND_WITH_IMM: the immediate in network order. */
	post_recv(b->qp, 101, b->buf, GRH + 64, b->mr->lkey);
	struct ibv_sge sge = {(uintptr_t)a->buf, 64, a->mr->lkey};
	struct ibv_send_wr w = ud_wr(&sge, 3, IBV_WR_SEND_WITH_IMM, to_b, b->qp->qp_num, QKEY);
	w.imm_data = htonl(0xfeedbeef);
	struct ibv_send_wr *bad = NULL;
	CHECK_RET(ibv_post_send(a->qp, &w, &bad), 0);
	sent(a, 3);
	received(b, &wc, 101, 64, a->qp->qp_num);
	CHECK(wc.wc_flags & IBV_WC_WITH_IMM);
	CHECK_EQ(wc.imm_data, htonl(0xfeedbeef));

	/* Inline: 204 bytes from a stack buffer reused at once; 205 is too many. */
	uint8_t stack[205];
	fill(stack, sizeof(stack), 3);
	uint8_t want[204];
	memcpy(want, stack, sizeof(want));
	post_recv(b->qp, 102, b->buf, GRH + 256, b->mr->lkey);
	struct ibv_sge isge = {(uintptr_t)stack, 204, 0};
	w = ud_wr(&isge, 4, IBV_WR_SEND, to_b, b->qp->qp_num, QKEY);
	w.send_flags = IBV_SEND_INLINE;
	CHECK_RET(ibv_post_send(a->qp, &w, &bad), 0);
	memset(stack, 0, sizeof(stack));
	sent(a, 4);
	received(b, &wc, 102, 204, a->qp->qp_num);
	CHECK_MEM(b->buf + GRH, want, 204);
	isge.length = 205;
	bad = NULL;
	CHECK_RET(ibv_post_send(a->qp, &w, &bad), ENOMEM);
	CHECK(bad == &w);

	/* A wrong Q_Key: the datagram is dropped silently; the receive stays posted. */
	post_recv(b->qp, 103, b->buf, GRH + 256, b->mr->lkey);
	send_ud(a, 5, 0, 16, to_b, b->qp->qp_num, QKEY ^ 1);
	sent(a, 5);
	EXPECT_NO_WC(b->cq, 200);
	/* Bit 31 of the Q_Key: the sender's own Q_Key (QKEY) goes out. */
	send_ud(a, 6, 0, 16, to_b, b->qp->qp_num, 0x80000000u);
	sent(a, 6);
	received(b, &wc, 103, 16, a->qp->qp_num);

	/* RC operations on a UD QP are refused, with bad_wr; the requests before stay posted. */
	post_recv(b->qp, 104, b->buf, GRH + 256, b->mr->lkey);
	struct ibv_send_wr l[3];
	struct ibv_sge ls = {(uintptr_t)a->buf, 8, a->mr->lkey};
	l[0] = ud_wr(&ls, 7, IBV_WR_SEND, to_b, b->qp->qp_num, QKEY);
	l[1] = ud_wr(&ls, 8, IBV_WR_RDMA_WRITE, to_b, b->qp->qp_num, QKEY);
	l[1].wr.rdma.remote_addr = (uintptr_t)b->buf;
	l[1].wr.rdma.rkey = b->mr->rkey;
	l[2] = ud_wr(&ls, 9, IBV_WR_SEND, to_b, b->qp->qp_num, QKEY);
	l[0].next = &l[1];
	l[1].next = &l[2];
	bad = NULL;
	CHECK_RET(ibv_post_send(a->qp, &l[0], &bad), EINVAL);
	CHECK(bad == &l[1]);
	sent(a, 7);
	received(b, &wc, 104, 8, a->qp->qp_num);
	const enum ibv_wr_opcode rc_only[] = {IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM,
					      IBV_WR_RDMA_READ, IBV_WR_ATOMIC_CMP_AND_SWP,
					      IBV_WR_ATOMIC_FETCH_AND_ADD};
	for (size_t i = 0; i < sizeof(rc_only) / sizeof(rc_only[0]); i++) {
		w = ud_wr(&ls, 10, rc_only[i], to_b, b->qp->qp_num, QKEY);
		bad = NULL;
		CHECK_RET(ibv_post_send(a->qp, &w, &bad), EINVAL);
		CHECK(bad == &w);
	}
	EXPECT_NO_WC(a->cq, 20);

	/* An AH of another PD (of the same context): EINVAL at post time, nothing sent. */
	struct ibv_pd *other = ibv_alloc_pd(a->ctx);
	CHECK(other != NULL);
	struct ibv_ah *foreign = ah_to(other, &b->gid);
	w = ud_wr(&ls, 11, IBV_WR_SEND, foreign, b->qp->qp_num, QKEY);
	bad = NULL;
	CHECK_RET(ibv_post_send(a->qp, &w, &bad), EINVAL);
	CHECK(bad == &w);
	EXPECT_NO_WC(a->cq, 20);
	CHECK_RET(ibv_destroy_ah(foreign), 0);
	CHECK_RET(ibv_dealloc_pd(other), 0);

	/* Several datagrams in one list, to two receive buffers and a third after it. */
	for (int i = 0; i < 3; i++)
		post_recv(b->qp, 110 + i, b->buf + i * 1024, 1024, b->mr->lkey);
	struct ibv_sge ms[3];
	for (int i = 0; i < 3; i++) {
		fill(a->buf + 4096 * i, 500, 10 + i);
		ms[i] = (struct ibv_sge){(uintptr_t)a->buf + 4096 * i, 500, a->mr->lkey};
		l[i] = ud_wr(&ms[i], 20 + i, IBV_WR_SEND, to_b, b->qp->qp_num, QKEY);
		l[i].next = i < 2 ? &l[i + 1] : NULL;
	}
	CHECK_RET(ibv_post_send(a->qp, &l[0], &bad), 0);
	for (int i = 0; i < 3; i++)
		sent(a, 20 + i);
	for (int i = 0; i < 3; i++) {
		received(b, &wc, 110 + i, 500, a->qp->qp_num);
		CHECK_MEM(b->buf + i * 1024 + GRH, a->buf + 4096 * i, 500);
	}
	CHECK_RET(ibv_destroy_ah(to_b), 0);
	printf("  traffic (%s): GRH, src_qp, reply from the completion, imm, inline, Q_Keys, "
	       "RC opcodes and foreign AHs refused\n",
	       what);
}

/* The ibv_wr_* builder on a UD QP, received on an extended CQ. */
static void builder(void)
{
	struct ud a, b;
	ud_open(&a, "rb0");
	memset(&b, 0, sizeof(b));
	b.ctx = open_dev("rb1");
	b.gid = gid_of(b.ctx);
	b.pd = ibv_alloc_pd(b.ctx);
	CHECK(b.pd != NULL);
	struct ibv_cq_init_attr_ex cx = {
		.cqe = 64,
		.wc_flags = IBV_WC_STANDARD_FLAGS,
	};
	struct ibv_cq_ex *bcq = ibv_create_cq_ex(b.ctx, &cx);
	CHECK(bcq != NULL);
	b.cq = ibv_cq_ex_to_cq(bcq);
	b.buf = page_buf();
	b.mr = ibv_reg_mr(b.pd, b.buf, BUF, IBV_ACCESS_LOCAL_WRITE);
	CHECK(b.mr != NULL);
	b.qp = ud_create(&b, 0);
	ud_ready(b.qp, QKEY, 0);

	/* A's builder QP. */
	struct ibv_qp_init_attr_ex ax = {
		.send_cq = a.cq,
		.recv_cq = a.cq,
		.cap = {.max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 2,
			.max_recv_sge = 1, .max_inline_data = 128},
		.qp_type = IBV_QPT_UD,
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
		.pd = a.pd,
		.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM,
	};
	struct ibv_qp *q = ibv_create_qp_ex(a.ctx, &ax);
	CHECK(q != NULL);
	ud_ready(q, QKEY, 7);
	struct ibv_qp_ex *qx = ibv_qp_to_qp_ex(q);
	CHECK(qx != NULL);
	struct ibv_ah *ah = ah_to(a.pd, &b.gid);

	fill(a.buf, 700, 5);
	post_recv(b.qp, 1, b.buf, 2048, b.mr->lkey);
	post_recv(b.qp, 2, b.buf + 2048, 2048, b.mr->lkey);
	ibv_wr_start(qx);
	qx->wr_id = 50;
	qx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send(qx);
	ibv_wr_set_ud_addr(qx, ah, b.qp->qp_num, QKEY);
	ibv_wr_set_sge(qx, a.mr->lkey, (uintptr_t)a.buf, 700);
	qx->wr_id = 51;
	ibv_wr_send_imm(qx, htonl(99));
	ibv_wr_set_ud_addr(qx, ah, b.qp->qp_num, QKEY);
	ibv_wr_set_inline_data(qx, "hello", 5);
	CHECK_RET(ibv_wr_complete(qx), 0);
	struct ibv_wc wc;
	for (uint64_t id = 50; id <= 51; id++) {
		EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
		CHECK_EQ(wc.wr_id, id);
		CHECK_EQ(wc.qp_num, q->qp_num);
	}
	/* The extended CQ's readers. */
	START_POLL(bcq);
	CHECK_EQ(bcq->status, IBV_WC_SUCCESS);
	CHECK_EQ(bcq->wr_id, 1);
	CHECK_EQ(ibv_wc_read_opcode(bcq), IBV_WC_RECV);
	CHECK_EQ(ibv_wc_read_byte_len(bcq), GRH + 700);
	CHECK_EQ(ibv_wc_read_qp_num(bcq), b.qp->qp_num);
	CHECK_EQ(ibv_wc_read_src_qp(bcq), q->qp_num);
	CHECK(ibv_wc_read_wc_flags(bcq) & IBV_WC_GRH);
	CHECK_EQ(ibv_wc_read_wc_flags(bcq) & IBV_WC_WITH_IMM, 0);
	CHECK_EQ(ibv_wc_read_slid(bcq), 0);
	/* RoCE: the frame type in sl, as ConnectX reports it (UDP bit, L3 type IPv4). */
	CHECK_EQ(ibv_wc_read_sl(bcq), 0xa);
	CHECK_EQ(ibv_wc_read_dlid_path_bits(bcq), 0);
	CHECK_MEM(b.buf + GRH, a.buf, 700);
	check_grh(b.buf, &a.gid, &b.gid);
	ibv_end_poll(bcq);
	START_POLL(bcq);
	CHECK_EQ(bcq->status, IBV_WC_SUCCESS);
	CHECK_EQ(bcq->wr_id, 2);
	CHECK_EQ(ibv_wc_read_byte_len(bcq), GRH + 5);
	CHECK_EQ(ibv_wc_read_src_qp(bcq), q->qp_num);
	CHECK_EQ(ibv_wc_read_wc_flags(bcq) & (IBV_WC_GRH | IBV_WC_WITH_IMM),
		 IBV_WC_GRH | IBV_WC_WITH_IMM);
	CHECK_EQ(ibv_wc_read_imm_data(bcq), htonl(99));
	ibv_end_poll(bcq);
	CHECK_MEM(b.buf + 2048 + GRH, "hello", 5);

	/* No destination, an RC operation the QP was not made for, and an AH of another PD:
	 * nothing is posted. */
	ibv_wr_start(qx);
	ibv_wr_send(qx);
	ibv_wr_set_sge(qx, a.mr->lkey, (uintptr_t)a.buf, 8);
	CHECK_RET(ibv_wr_complete(qx), EINVAL);
	ibv_wr_start(qx);
	ibv_wr_rdma_write(qx, b.mr->rkey, (uintptr_t)b.buf);
	ibv_wr_set_ud_addr(qx, ah, b.qp->qp_num, QKEY);
	ibv_wr_set_sge(qx, a.mr->lkey, (uintptr_t)a.buf, 8);
	CHECK_RET(ibv_wr_complete(qx), EINVAL);
	struct ibv_pd *other = ibv_alloc_pd(a.ctx);
	CHECK(other != NULL);
	struct ibv_ah *foreign = ah_to(other, &b.gid);
	ibv_wr_start(qx);
	ibv_wr_send(qx);
	ibv_wr_set_ud_addr(qx, foreign, b.qp->qp_num, QKEY);
	ibv_wr_set_sge(qx, a.mr->lkey, (uintptr_t)a.buf, 8);
	CHECK_RET(ibv_wr_complete(qx), EINVAL);
	EXPECT_NO_WC(a.cq, 20);
	/* An abandoned build. */
	ibv_wr_start(qx);
	ibv_wr_send(qx);
	ibv_wr_set_ud_addr(qx, ah, b.qp->qp_num, QKEY);
	ibv_wr_abort(qx);
	EXPECT_NO_WC(a.cq, 20);
	CHECK_RET(ibv_destroy_ah(foreign), 0);
	CHECK_RET(ibv_dealloc_pd(other), 0);
	CHECK_RET(ibv_destroy_ah(ah), 0);
	CHECK_RET(ibv_destroy_qp(q), 0);
	ud_close(&a);
	ud_close(&b);
	printf("  builder: ibv_wr_set_ud_addr, send and send_imm, the extended CQ's readers\n");
}

/* A datagram above the port MTU (4096 bytes) is a local length error. */
static void too_long(void)
{
	struct ud a, b;
	ud_open(&a, "rb0");
	ud_open(&b, "rb1");
	struct ibv_ah *ah = ah_to(a.pd, &b.gid);
	post_recv(b.qp, 1, b.buf, 8192 + GRH, b.mr->lkey);
	send_ud(&a, 1, 0, 4097, ah, b.qp->qp_num, QKEY);
	struct ibv_wc wc;
	EXPECT_WC(a.cq, &wc, IBV_WC_LOC_LEN_ERR, -1);
	CHECK_EQ(wc.wr_id, 1);
	EXPECT_NO_WC(b.cq, 100);
	CHECK_RET(ibv_destroy_ah(ah), 0);
	ud_close(&a);
	ud_close(&b);
	printf("  4097 bytes: IBV_WC_LOC_LEN_ERR, nothing received\n");
}

/* Multicast (ibv_attach_mcast(3)): a datagram to a group (an AH to ::ffff:239.1.2.3, QPN
 * 0xFFFFFF) reaches every attached QP once, the sender's own NIC's included; a detached or
 * unattached QP gets nothing; a QP attached to a group cannot be destroyed (EBUSY); what
 * is refused; the limits ibv_query_device gives hold. */
static void multicast(void)
{
	struct ud a, b;
	ud_open(&a, "rb0");
	ud_open(&b, "rb1");
	union ibv_gid grp = {0};
	grp.raw[10] = grp.raw[11] = 0xff;
	grp.raw[12] = 239, grp.raw[13] = 1, grp.raw[14] = 2, grp.raw[15] = 3;
	union ibv_gid uni = b.gid;
	CHECK_RET(ibv_attach_mcast(b.qp, &uni, 0), EINVAL);
	CHECK_RET(ibv_attach_mcast(b.qp, NULL, 0), EINVAL);
	CHECK_RET(ibv_attach_mcast(b.qp, &grp, 0), 0);
	CHECK_RET(ibv_attach_mcast(b.qp, &grp, 0), 0);
	struct ibv_qp *b2 = ud_create(&b, 0);
	ud_ready(b2, QKEY, 0);
	CHECK_RET(ibv_attach_mcast(b2, &grp, 0), 0);
	struct ibv_qp *idle = ud_create(&b, 0);
	ud_ready(idle, QKEY, 0);
	for (int i = 0; i < 2; i++) {
		post_recv(b.qp, 100 + i, b.buf + i * 1024, 1024, b.mr->lkey);
		post_recv(b2, 200 + i, b.buf + 4096 + i * 1024, 1024, b.mr->lkey);
		post_recv(idle, 300 + i, b.buf + 8192 + i * 1024, 1024, b.mr->lkey);
	}
	/* An address handle to the group. */
	struct ibv_ah *ah = ah_to(a.pd, &grp);
	memcpy(a.buf, "to the group", 12);
	send_ud(&a, 1, 0, 12, ah, 0xffffff, QKEY);
	sent(&a, 1);
	struct ibv_wc wc;
	int seen_b = 0, seen_b2 = 0;
	for (int k = 0; k < 2; k++) {
		EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
		CHECK_EQ(wc.byte_len, 40 + 12);
		CHECK_EQ(wc.src_qp, a.qp->qp_num);
		seen_b += wc.qp_num == b.qp->qp_num;
		seen_b2 += wc.qp_num == b2->qp_num;
	}
	CHECK(seen_b == 1 && seen_b2 == 1);
	CHECK(memcmp(b.buf + 40, "to the group", 12) == 0);
	EXPECT_NO_WC(b.cq, 200);
	/* Attached QPs hold: EBUSY until detached; a second detach is EINVAL. */
	CHECK_RET(ibv_destroy_qp(b2), EBUSY);
	CHECK_RET(ibv_detach_mcast(b2, &grp, 0), 0);
	CHECK_RET(ibv_detach_mcast(b2, &grp, 0), EINVAL);
	/* The sender's own NIC: attached, it receives its own group's datagram too. */
	CHECK_RET(ibv_attach_mcast(a.qp, &grp, 0), 0);
	post_recv(a.qp, 400, a.buf + 4096, 1024, a.mr->lkey);
	send_ud(&a, 2, 0, 12, ah, 0xffffff, QKEY);
	int got_send = 0, got_recv = 0;
	for (int k = 0; k < 2; k++) {
		POLL_ONE(a.cq, &wc);
		CHECK_EQ(wc.status, IBV_WC_SUCCESS);
		got_send += wc.opcode == IBV_WC_SEND;
		got_recv += wc.opcode == IBV_WC_RECV && wc.wr_id == 400;
	}
	CHECK(got_send == 1 && got_recv == 1);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.qp_num, b.qp->qp_num);
	EXPECT_NO_WC(b.cq, 200);
	CHECK_RET(ibv_detach_mcast(a.qp, &grp, 0), 0);
	CHECK_RET(ibv_detach_mcast(b.qp, &grp, 0), 0);
	/* The device's limits: attachments past max_total_mcast_qp_attach are ENOMEM, and
	 * ibv_query_device says how many groups and attachments there may be. */
	struct ibv_device_attr da;
	CHECK_OK(ibv_query_device(b.ctx, &da));
	CHECK(da.max_mcast_grp > 0);
	CHECK(da.max_mcast_qp_attach > 0);
	CHECK(da.max_total_mcast_qp_attach >= da.max_mcast_qp_attach);
	int total = da.max_total_mcast_qp_attach;
	CHECK(total <= da.max_mcast_grp); /* one QP per group below reaches the total */
	union ibv_gid g = grp;
	for (int i = 0; i < total; i++) {
		g.raw[14] = (uint8_t)(i >> 8), g.raw[15] = (uint8_t)i;
		CHECK_RET(ibv_attach_mcast(b2, &g, 0), 0);
	}
	g.raw[14] = 0xff, g.raw[15] = 0xff;
	CHECK_RET(ibv_attach_mcast(b2, &g, 0), ENOMEM);
	for (int i = 0; i < total; i++) {
		g.raw[14] = (uint8_t)(i >> 8), g.raw[15] = (uint8_t)i;
		CHECK_RET(ibv_detach_mcast(b2, &g, 0), 0);
	}
	CHECK_RET(ibv_destroy_qp(b2), 0);
	CHECK_RET(ibv_destroy_qp(idle), 0);
	CHECK_RET(ibv_destroy_ah(ah), 0);
	/* An RC QP has no groups; a group is no path for a connection. */
	struct side r;
	side_open(&r, "rb0", 4096, 16);
	struct qp_opts o = default_qp_opts();
	struct ibv_qp *rc = side_qp(&r, &o);
	CHECK_RET(ibv_attach_mcast(rc, &grp, 0), EOPNOTSUPP);
	qp_to_init(rc);
	struct ibv_qp_attr at = rtr_attr(2, &grp, &o);
	CHECK_RET(ibv_modify_qp(rc, &at, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
						IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
						IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER),
		  EINVAL);
	side_close(&r);
	ud_close(&a);
	ud_close(&b);
}

int main(void)
{
	creation();
	address_handles();
	struct ud a, b;
	ud_open(&a, "rb0");
	ud_open(&b, "rb1");
	traffic(&a, &b, "rb0 and rb1");
	ud_close(&b);
	/* Two contexts of one NIC, as rdma-core's tests run. */
	ud_open(&b, "rb0");
	traffic(&a, &b, "two contexts of rb0");
	ud_close(&a);
	ud_close(&b);
	builder();
	too_long();
	multicast();
	printf("ud: all checks passed\n");
	return 0;
}
