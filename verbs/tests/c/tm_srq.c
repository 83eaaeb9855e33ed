/* Tag matching: a TM-SRQ (ibv_create_srq_ex, IBV_SRQT_TM) on an extended CQ with
 * IBV_WC_EX_WITH_TM_INFO; ibv_post_srq_ops TAG_ADD, TAG_DEL and TAG_SYNC; eager messages with
 * rdma-core's TMH (<infiniband/tm_types.h>, big-endian) matched into tagged buffers (TMH
 * stripped, TM_MATCH | TM_DATA_VALID, the tag and app_ctx through ibv_wc_read_tm_info), with
 * a mask, unexpected into the SRQ's plain buffers (whole message, no match flags) and then
 * synchronised, NO_TAG, a deleted tag, a stale DEL, and a rendezvous (TMH + struct ibv_rvh)
 * that the receiving NIC reads into the tagged buffer and answers with a FIN. The flows and
 * flags are those rdma-core's tests/test_tag_matching.py expects. */
#include "common.h"
#include <endian.h>
#include <infiniband/tm_types.h>

static struct side a, b;
static struct ibv_cq_ex *cqx; /* the TM-SRQ's CQ */
static struct ibv_srq *srq;
static uint32_t unexpected; /* unexpected messages seen, for TAG_SYNC */

/* One completion of the extended CQ, read through the ibv_wc_read_* calls. */
struct xwc {
	enum ibv_wc_status status;
	uint64_t wr_id;
	enum ibv_wc_opcode opcode;
	unsigned flags;
	uint32_t byte_len, qp_num;
	struct ibv_wc_tm_info tm;
};

#define XPOLL(x) xpoll_at(__FILE__, __LINE__, (x))
static void xpoll_at(const char *file, int line, struct xwc *x)
{
	start_poll_at(file, line, cqx);
	memset(x, 0, sizeof(*x));
	x->status = cqx->status;
	x->wr_id = cqx->wr_id;
	x->opcode = ibv_wc_read_opcode(cqx);
	x->flags = ibv_wc_read_wc_flags(cqx);
	x->byte_len = ibv_wc_read_byte_len(cqx);
	x->qp_num = ibv_wc_read_qp_num(cqx);
	ibv_wc_read_tm_info(cqx, &x->tm);
	ibv_end_poll(cqx);
}

/* The next TM-SRQ completion must be `op` with `status` for `wr_id`. */
#define EXPECT_X(x, st, op, id)                                                          \
	do {                                                                             \
		xpoll_at(__FILE__, __LINE__, (x));                                       \
		if ((x)->status != (st) || (x)->opcode != (op) ||                       \
		    (x)->wr_id != (uint64_t)(id))                                        \
			FAIL("TM completion: status %d (%s) opcode %d wr_id %" PRIu64    \
			     " flags 0x%x; want status %d opcode %d wr_id %" PRIu64,     \
			     (x)->status, ibv_wc_status_str((x)->status), (x)->opcode,   \
			     (x)->wr_id, (x)->flags, (int)(st), (int)(op), (uint64_t)(id)); \
	} while (0)

#define TM_FLAGS (IBV_WC_TM_MATCH | IBV_WC_TM_DATA_VALID | IBV_WC_TM_SYNC_REQ)

/* TAG_ADD of b.buf[off..off+len) for `tag`/`mask`; returns the handle after its
 * completion (which must not ask for a sync). */
static uint32_t tag_add(uint64_t wr_id, uint64_t recv_wr_id, uint64_t tag, uint64_t mask,
			size_t off, uint32_t len, unsigned *cflags)
{
	struct ibv_sge sge = {(uintptr_t)b.buf + off, len, b.mr->lkey};
	struct ibv_ops_wr op = {
		.wr_id = wr_id,
		.opcode = IBV_WR_TAG_ADD,
		.flags = IBV_OPS_SIGNALED | IBV_OPS_TM_SYNC,
	};
	op.tm.unexpected_cnt = unexpected;
	op.tm.handle = 0xdeadbeef;
	op.tm.add.recv_wr_id = recv_wr_id;
	op.tm.add.sg_list = &sge;
	op.tm.add.num_sge = 1;
	op.tm.add.tag = tag;
	op.tm.add.mask = mask;
	struct ibv_ops_wr *bad = NULL;
	CHECK_RET(ibv_post_srq_ops(srq, &op, &bad), 0);
	CHECK(op.tm.handle != 0xdeadbeef);
	struct xwc x;
	EXPECT_X(&x, IBV_WC_SUCCESS, IBV_WC_TM_ADD, wr_id);
	if (cflags)
		*cflags = x.flags;
	else
		CHECK_EQ(x.flags & TM_FLAGS, 0);
	return op.tm.handle;
}

static void tag_sync(uint64_t wr_id)
{
	struct ibv_ops_wr op = {
		.wr_id = wr_id,
		.opcode = IBV_WR_TAG_SYNC,
		.flags = IBV_OPS_SIGNALED | IBV_OPS_TM_SYNC,
	};
	op.tm.unexpected_cnt = unexpected;
	struct ibv_ops_wr *bad = NULL;
	CHECK_RET(ibv_post_srq_ops(srq, &op, &bad), 0);
	struct xwc x;
	EXPECT_X(&x, IBV_WC_SUCCESS, IBV_WC_TM_SYNC, wr_id);
	CHECK_EQ(x.flags & TM_FLAGS, 0);
}

static enum ibv_wc_status tag_del(uint64_t wr_id, uint32_t handle)
{
	struct ibv_ops_wr op = {
		.wr_id = wr_id,
		.opcode = IBV_WR_TAG_DEL,
		.flags = IBV_OPS_SIGNALED,
	};
	op.tm.handle = handle;
	struct ibv_ops_wr *bad = NULL;
	CHECK_RET(ibv_post_srq_ops(srq, &op, &bad), 0);
	struct xwc x;
	xpoll_at(__FILE__, __LINE__, &x);
	CHECK_EQ(x.opcode, IBV_WC_TM_DEL);
	CHECK_EQ(x.wr_id, wr_id);
	return x.status;
}

/* Writes a TMH at a.buf[off] and a payload of `len` bytes after it; SENDs both. */
static void send_tagged(uint64_t wr_id, uint8_t opcode, uint32_t app_ctx, uint64_t tag,
			size_t off, uint32_t len, unsigned seed)
{
	struct ibv_tmh tmh = {.opcode = opcode};
	tmh.app_ctx = htobe32(app_ctx);
	tmh.tag = htobe64(tag);
	CHECK_EQ(sizeof(tmh), 16);
	memcpy(a.buf + off, &tmh, sizeof(tmh));
	fill(a.buf + off + sizeof(tmh), len, seed);
	post_send_buf(a.qp, wr_id, a.buf + off, sizeof(tmh) + len, a.mr->lkey);
	struct ibv_wc wc;
	EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	CHECK_EQ(wc.wr_id, wr_id);
}

static void creation_errors(struct ibv_tm_caps *caps)
{
	struct ibv_srq_init_attr_ex sx = {
		.attr = {.max_wr = 16, .max_sge = 1},
		.comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD | IBV_SRQ_INIT_ATTR_CQ |
			     IBV_SRQ_INIT_ATTR_TM,
		.srq_type = IBV_SRQT_TM,
		.pd = b.pd,
		.cq = ibv_cq_ex_to_cq(cqx),
		.tm_cap = {.max_num_tags = 0, .max_ops = 16},
	};
	CHECK_NULL_ERRNO(ibv_create_srq_ex(b.ctx, &sx), EINVAL);
	sx.tm_cap.max_num_tags = caps->max_num_tags + 1;
	CHECK_NULL_ERRNO(ibv_create_srq_ex(b.ctx, &sx), EINVAL);
	sx.tm_cap.max_num_tags = 16;
	sx.tm_cap.max_ops = 0;
	CHECK_NULL_ERRNO(ibv_create_srq_ex(b.ctx, &sx), EINVAL);
	sx.tm_cap.max_ops = 16;
	sx.comp_mask &= ~IBV_SRQ_INIT_ATTR_CQ;
	CHECK_NULL_ERRNO(ibv_create_srq_ex(b.ctx, &sx), EINVAL);
	sx.comp_mask |= IBV_SRQ_INIT_ATTR_CQ;
	sx.comp_mask &= ~IBV_SRQ_INIT_ATTR_TM;
	CHECK_NULL_ERRNO(ibv_create_srq_ex(b.ctx, &sx), EINVAL);
	sx.comp_mask |= IBV_SRQ_INIT_ATTR_TM;
	sx.cq = a.cq; /* another context's CQ */
	CHECK_NULL_ERRNO(ibv_create_srq_ex(b.ctx, &sx), EINVAL);
}

int main(void)
{
	struct qp_opts o = default_qp_opts();
	side_open(&a, "rb0", 1 << 16, 64);
	side_open(&b, "rb1", 1 << 16, 64);

	struct ibv_device_attr_ex dx;
	CHECK_RET(ibv_query_device_ex(b.ctx, NULL, &dx), 0);
	CHECK(dx.tm_caps.flags & IBV_TM_CAP_RC);
	CHECK(dx.tm_caps.max_num_tags >= 16);
	CHECK(dx.tm_caps.max_ops >= 16);
	CHECK(dx.tm_caps.max_rndv_hdr_size >= sizeof(struct ibv_tmh) + sizeof(struct ibv_rvh));

	struct ibv_cq_init_attr_ex ca = {
		.cqe = 64,
		.wc_flags = IBV_WC_STANDARD_FLAGS | IBV_WC_EX_WITH_TM_INFO,
	};
	cqx = ibv_create_cq_ex(b.ctx, &ca);
	CHECK(cqx != NULL);
	creation_errors(&dx.tm_caps);

	struct ibv_srq_init_attr_ex sx = {
		.attr = {.max_wr = 16, .max_sge = 1},
		.comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD | IBV_SRQ_INIT_ATTR_CQ |
			     IBV_SRQ_INIT_ATTR_TM,
		.srq_type = IBV_SRQT_TM,
		.pd = b.pd,
		.cq = ibv_cq_ex_to_cq(cqx),
		.tm_cap = {.max_num_tags = 16, .max_ops = 16},
	};
	srq = ibv_create_srq_ex(b.ctx, &sx);
	CHECK(srq != NULL);
	CHECK_RET(ibv_destroy_cq(ibv_cq_ex_to_cq(cqx)), EBUSY);

	/* b's QP receives through the TM-SRQ; a's QP has a receive queue of its own (for the
	 * rendezvous FIN). */
	struct qp_opts os = o;
	os.srq = srq;
	side_qp(&a, &o);
	{
		struct ibv_qp_init_attr ia = {
			.send_cq = b.cq,
			.recv_cq = ibv_cq_ex_to_cq(cqx),
			.srq = srq,
			.cap = {.max_send_wr = 16, .max_send_sge = 1},
			.qp_type = IBV_QPT_RC,
		};
		b.qp = ibv_create_qp(b.pd, &ia);
		CHECK(b.qp != NULL);
	}
	sides_connect(&a, &o, &b, &os);

	/* Untagged buffers for unexpected and untagged messages. */
	enum { UNTAGGED = 32768 };
	for (int i = 0; i < 8; i++)
		post_srq_recv(srq, 500 + i, b.buf + UNTAGGED + 512 * i, 512, b.mr->lkey);
	int next_untagged = 0;

	/* Refused list operations. */
	{
		struct ibv_sge two[2] = {{(uintptr_t)b.buf, 8, b.mr->lkey},
					 {(uintptr_t)b.buf + 8, 8, b.mr->lkey}};
		struct ibv_ops_wr op = {.wr_id = 9, .opcode = IBV_WR_TAG_ADD,
					.flags = IBV_OPS_SIGNALED};
		op.tm.add.sg_list = two;
		op.tm.add.num_sge = 2;
		struct ibv_ops_wr *bad = NULL;
		CHECK_RET(ibv_post_srq_ops(srq, &op, &bad), EINVAL);
		CHECK(bad == &op);
		op.opcode = 77;
		op.tm.add.num_sge = 1;
		bad = NULL;
		CHECK_RET(ibv_post_srq_ops(srq, &op, &bad), EINVAL);
		CHECK(bad == &op);
		/* List operations on a plain SRQ. */
		struct ibv_srq_init_attr pa = {.attr = {.max_wr = 4, .max_sge = 1}};
		struct ibv_srq *plain = ibv_create_srq(b.pd, &pa);
		CHECK(plain != NULL);
		op.opcode = IBV_WR_TAG_SYNC;
		bad = NULL;
		CHECK(ibv_post_srq_ops(plain, &op, &bad) != 0);
		CHECK(bad == &op);
		CHECK_RET(ibv_destroy_srq(plain), 0);
		EXPECT_NO_WC(ibv_cq_ex_to_cq(cqx), 20);
	}

	struct xwc x;

	/* ---- eager, matched: the payload lands at offset 0 of the tagged buffer ---- */
	uint32_t h1 = tag_add(1, 100, 0x1122334455667788ull, ~0ull, 0, 4096, NULL);
	send_tagged(11, IBV_TMH_EAGER, 0xabcd0123, 0x1122334455667788ull, 0, 200, 1);
	EXPECT_X(&x, IBV_WC_SUCCESS, IBV_WC_TM_RECV, 100);
	CHECK_EQ(x.flags & TM_FLAGS, IBV_WC_TM_MATCH | IBV_WC_TM_DATA_VALID);
	CHECK_EQ(x.tm.tag, 0x1122334455667788ull);
	CHECK_EQ(x.tm.priv, 0xabcd0123);
	CHECK_EQ(x.byte_len, 200);
	CHECK_EQ(x.qp_num, b.qp->qp_num);
	CHECK_MEM(b.buf, a.buf + sizeof(struct ibv_tmh), 200);
	printf("  eager: matched tag 0x1122334455667788 (handle %u), TMH stripped\n", h1);

	/* ---- a mask: tag bits outside it do not matter ---- */
	tag_add(2, 101, 0x1200, 0xff00, 4096, 4096, NULL);
	send_tagged(12, IBV_TMH_EAGER, 7, 0x12ab, 0, 64, 2);
	EXPECT_X(&x, IBV_WC_SUCCESS, IBV_WC_TM_RECV, 101);
	CHECK_EQ(x.flags & TM_FLAGS, IBV_WC_TM_MATCH | IBV_WC_TM_DATA_VALID);
	CHECK_EQ(x.tm.tag, 0x12ab);
	CHECK_EQ(x.byte_len, 64);
	CHECK_MEM(b.buf + 4096, a.buf + sizeof(struct ibv_tmh), 64);

	/* ---- unexpected: a plain buffer takes the whole message, no match flags ---- */
	send_tagged(13, IBV_TMH_EAGER, 9, 0x9999, 0, 48, 3);
	EXPECT_X(&x, IBV_WC_SUCCESS, IBV_WC_TM_RECV, 500 + next_untagged);
	CHECK_EQ(x.flags & (IBV_WC_TM_MATCH | IBV_WC_TM_DATA_VALID), 0);
	CHECK_EQ(x.byte_len, sizeof(struct ibv_tmh) + 48);
	CHECK_MEM(b.buf + UNTAGGED + 512 * next_untagged, a.buf, sizeof(struct ibv_tmh) + 48);
	next_untagged++;
	unexpected++;
	/* An ADD reporting the old count is out of sync: its completion asks for a SYNC. */
	unsigned cflags = 0;
	uint32_t saved = unexpected;
	unexpected = 0;
	tag_add(3, 102, 0x3333, ~0ull, 8192, 4096, &cflags);
	unexpected = saved;
	CHECK(cflags & IBV_WC_TM_SYNC_REQ);
	/* TAG_SYNC with the count enables it. */
	tag_sync(4);
	send_tagged(14, IBV_TMH_EAGER, 3, 0x3333, 0, 100, 4);
	EXPECT_X(&x, IBV_WC_SUCCESS, IBV_WC_TM_RECV, 102);
	CHECK_EQ(x.flags & TM_FLAGS, IBV_WC_TM_MATCH | IBV_WC_TM_DATA_VALID);
	CHECK_EQ(x.tm.tag, 0x3333);
	CHECK_MEM(b.buf + 8192, a.buf + sizeof(struct ibv_tmh), 100);
	printf("  unexpected: whole message in a plain buffer; SYNC_REQ, TAG_SYNC\n");

	/* ---- NO_TAG: never matched, not counted ---- */
	tag_add(5, 103, 0, 0, 12288, 4096, NULL); /* matches every tag, but not NO_TAG */
	send_tagged(15, IBV_TMH_NO_TAG, 0, 0, 0, 30, 5);
	EXPECT_X(&x, IBV_WC_SUCCESS, IBV_WC_TM_NO_TAG, 500 + next_untagged);
	CHECK_EQ(x.flags & (IBV_WC_TM_MATCH | IBV_WC_TM_DATA_VALID), 0);
	CHECK_EQ(x.byte_len, sizeof(struct ibv_tmh) + 30);
	CHECK_MEM(b.buf + UNTAGGED + 512 * next_untagged, a.buf, sizeof(struct ibv_tmh) + 30);
	next_untagged++;
	/* The match-all entry is still there: it takes the next tagged message. */
	send_tagged(16, IBV_TMH_EAGER, 0, 0x4242, 0, 10, 6);
	EXPECT_X(&x, IBV_WC_SUCCESS, IBV_WC_TM_RECV, 103);
	CHECK_EQ(x.tm.tag, 0x4242);
	printf("  NO_TAG: untagged buffer, TM_NO_TAG\n");

	/* ---- TAG_DEL: a deleted tag no longer matches; a second DEL fails ---- */
	uint32_t h = tag_add(6, 104, 0x5555, ~0ull, 16384, 4096, NULL);
	CHECK_EQ(tag_del(7, h), IBV_WC_SUCCESS);
	send_tagged(17, IBV_TMH_EAGER, 0, 0x5555, 0, 20, 7);
	EXPECT_X(&x, IBV_WC_SUCCESS, IBV_WC_TM_RECV, 500 + next_untagged);
	CHECK_EQ(x.flags & (IBV_WC_TM_MATCH | IBV_WC_TM_DATA_VALID), 0);
	next_untagged++;
	unexpected++;
	tag_sync(8);
	CHECK_EQ(tag_del(9, h), IBV_WC_TM_ERR);
	printf("  TAG_DEL: deleted tag goes unexpected; stale DEL is IBV_WC_TM_ERR\n");

	/* ---- rendezvous: the receiving NIC reads the data, then sends a FIN ---- */
	{
		enum { RNDV_SRC = 16384, RNDV_LEN = 3000, FIN_BUF = 40960 };
		fill(a.buf + RNDV_SRC, RNDV_LEN, 8);
		post_recv(a.qp, 700, a.buf + FIN_BUF, 256, a.mr->lkey);
		tag_add(10, 105, 0x7777, ~0ull, 20480, 4096, NULL);
		struct {
			struct ibv_tmh tmh;
			struct ibv_rvh rvh;
		} req = {0};
		CHECK_EQ(sizeof(req), 32);
		req.tmh.opcode = IBV_TMH_RNDV;
		req.tmh.app_ctx = htobe32(0x77);
		req.tmh.tag = htobe64(0x7777);
		req.rvh.va = htobe64((uintptr_t)a.buf + RNDV_SRC);
		req.rvh.rkey = htobe32(a.mr->rkey);
		req.rvh.len = htobe32(RNDV_LEN);
		memcpy(a.buf + 60000, &req, sizeof(req));
		post_send_buf(a.qp, 18, a.buf + 60000, sizeof(req), a.mr->lkey);
		struct ibv_wc wc;
		EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
		CHECK_EQ(wc.wr_id, 18);
		/* The match, then the data. */
		EXPECT_X(&x, IBV_WC_SUCCESS, IBV_WC_TM_RECV, 105);
		CHECK_EQ(x.flags & TM_FLAGS, IBV_WC_TM_MATCH);
		CHECK_EQ(x.tm.tag, 0x7777);
		CHECK_EQ(x.tm.priv, 0x77);
		EXPECT_X(&x, IBV_WC_SUCCESS, IBV_WC_TM_RECV, 105);
		CHECK_EQ(x.flags & TM_FLAGS, IBV_WC_TM_DATA_VALID);
		CHECK_EQ(x.byte_len, RNDV_LEN);
		CHECK_MEM(b.buf + 20480, a.buf + RNDV_SRC, RNDV_LEN);
		/* The FIN: the request's TMH with opcode FIN, then its RVH. */
		EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
		CHECK_EQ(wc.wr_id, 700);
		CHECK_EQ(wc.byte_len, 32);
		struct ibv_tmh fin;
		memcpy(&fin, a.buf + FIN_BUF, sizeof(fin));
		CHECK_EQ(fin.opcode, IBV_TMH_FIN);
		CHECK_EQ(be64toh(fin.tag), 0x7777);
		CHECK_EQ(be32toh(fin.app_ctx), 0x77);
		CHECK_MEM(a.buf + FIN_BUF + 16, &req.rvh, 16);
		printf("  rendezvous: %d bytes read by the NIC, FIN received\n", RNDV_LEN);
	}

	/* The first entries were consumed: their handles are free for new ADDs; fill the
	 * list and the next ADD is refused. */
	{
		int added = 0;
		for (;;) {
			struct ibv_sge sge = {(uintptr_t)b.buf, 64, b.mr->lkey};
			struct ibv_ops_wr op = {.wr_id = 1000 + added, .opcode = IBV_WR_TAG_ADD,
						.flags = IBV_OPS_SIGNALED};
			op.tm.add.recv_wr_id = 2000 + added;
			op.tm.add.sg_list = &sge;
			op.tm.add.num_sge = 1;
			op.tm.add.tag = 0xf000 + added;
			op.tm.add.mask = ~0ull;
			struct ibv_ops_wr *bad = NULL;
			int r = ibv_post_srq_ops(srq, &op, &bad);
			if (r != 0) {
				CHECK(bad == &op);
				break;
			}
			EXPECT_X(&x, IBV_WC_SUCCESS, IBV_WC_TM_ADD, 1000 + added);
			added++;
			CHECK(added <= 16);
		}
		CHECK_EQ(added, 16);
		printf("  list full after 16 ADDs: the 17th is refused\n");
	}

	/* Teardown: the QPs, then the SRQ, then its CQ. */
	CHECK_RET(ibv_destroy_srq(srq), EBUSY);
	CHECK_RET(ibv_destroy_qp(b.qp), 0);
	b.qp = NULL;
	CHECK_RET(ibv_destroy_srq(srq), 0);
	CHECK_RET(ibv_destroy_cq(ibv_cq_ex_to_cq(cqx)), 0);
	side_close(&a);
	side_close(&b);
	printf("tm_srq: ok\n");
	return 0;
}
