/* Every RC operation, with the data checked byte for byte on both sides: through
 * ibv_post_send (SEND with gather and scatter lists, SEND_WITH_IMM, RDMA_WRITE,
 * RDMA_WRITE_WITH_IMM, RDMA_READ, both atomics, inline data from a stack buffer reused at
 * once, a list of three requests), and through the ibv_wr_* builder of ibv_qp_ex. */
#include "common.h"

static struct side a, b;

/* Offsets in the 64 KiB buffers. */
enum {
	SEND_SRC = 0,
	WRITE_DST = 8192,
	WIMM_DST = 16384,
	READ_SRC = 20480,
	READ_DST = 30000,
	ATOMIC = 40960,
	LIST_DST = 45056,
};

static struct ibv_send_wr wr_of(uint64_t id, enum ibv_wr_opcode op, struct ibv_sge *sg, int n)
{
	struct ibv_send_wr w = {.wr_id = id, .sg_list = sg, .num_sge = n, .opcode = op,
				.send_flags = IBV_SEND_SIGNALED};
	return w;
}

static void post(struct ibv_qp *qp, struct ibv_send_wr *w)
{
	struct ibv_send_wr *bad = NULL;
	CHECK_RET(ibv_post_send(qp, w, &bad), 0);
}

static uint64_t *u64_at(uint8_t *buf, size_t off)
{
	return (uint64_t *)(void *)(buf + off);
}

/* The requester's completion of `id`. */
static void sent(uint64_t id, enum ibv_wc_opcode op)
{
	struct ibv_wc wc;
	EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, op);
	CHECK_EQ(wc.wr_id, id);
	CHECK_EQ(wc.qp_num, a.qp->qp_num);
}

static void classic(void)
{
	struct ibv_wc wc;

	/* SEND: 3 gather entries into 2 scatter entries. */
	fill(a.buf, 4096, 1);
	struct ibv_sge g[3] = {
		{(uintptr_t)a.buf + 0, 100, a.mr->lkey},
		{(uintptr_t)a.buf + 1000, 200, a.mr->lkey},
		{(uintptr_t)a.buf + 3000, 50, a.mr->lkey},
	};
	struct ibv_sge s[2] = {
		{(uintptr_t)b.buf + 0, 120, b.mr->lkey},
		{(uintptr_t)b.buf + 500, 300, b.mr->lkey},
	};
	struct ibv_recv_wr rw = {.wr_id = 1001, .sg_list = s, .num_sge = 2}, *rbad = NULL;
	CHECK_RET(ibv_post_recv(b.qp, &rw, &rbad), 0);
	struct ibv_send_wr w = wr_of(1, IBV_WR_SEND, g, 3);
	post(a.qp, &w);
	sent(1, IBV_WC_SEND);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 1001);
	CHECK_EQ(wc.byte_len, 350);
	CHECK_EQ(wc.qp_num, b.qp->qp_num);
	CHECK_EQ(wc.wc_flags & IBV_WC_WITH_IMM, 0);
	uint8_t want[350];
	memcpy(want, a.buf, 100);
	memcpy(want + 100, a.buf + 1000, 200);
	memcpy(want + 300, a.buf + 3000, 50);
	CHECK_MEM(b.buf, want, 120);
	CHECK_MEM(b.buf + 500, want + 120, 230);
	printf("  SEND: 3 gather entries, 2 scatter entries\n");

	/* SEND_WITH_IMM: the immediate arrives as sent (network order in both structs). */
	post_recv(b.qp, 1002, b.buf, 4096, b.mr->lkey);
	struct ibv_sge one = {(uintptr_t)a.buf, 2500, a.mr->lkey};
	w = wr_of(2, IBV_WR_SEND_WITH_IMM, &one, 1);
	w.imm_data = htonl(0x12345678);
	post(a.qp, &w);
	sent(2, IBV_WC_SEND);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 1002);
	CHECK_EQ(wc.byte_len, 2500);
	CHECK(wc.wc_flags & IBV_WC_WITH_IMM);
	CHECK_EQ(wc.imm_data, htonl(0x12345678));
	CHECK_MEM(b.buf, a.buf, 2500);
	printf("  SEND_WITH_IMM: imm 0x12345678 in network order\n");

	/* RDMA_WRITE of several MTUs; no receive is consumed. */
	fill(a.buf, 3000, 3);
	one.length = 3000;
	w = wr_of(3, IBV_WR_RDMA_WRITE, &one, 1);
	w.wr.rdma.remote_addr = (uintptr_t)b.buf + WRITE_DST;
	w.wr.rdma.rkey = b.mr->rkey;
	post(a.qp, &w);
	sent(3, IBV_WC_RDMA_WRITE);
	CHECK_MEM(b.buf + WRITE_DST, a.buf, 3000);
	EXPECT_NO_WC(b.cq, 50);
	printf("  RDMA_WRITE: 3000 bytes\n");

	/* RDMA_WRITE_WITH_IMM: data at the address, a receive consumed with the immediate. */
	fill(a.buf, 500, 4);
	post_recv(b.qp, 1004, b.buf, 16, b.mr->lkey);
	one.length = 500;
	w = wr_of(4, IBV_WR_RDMA_WRITE_WITH_IMM, &one, 1);
	w.wr.rdma.remote_addr = (uintptr_t)b.buf + WIMM_DST;
	w.wr.rdma.rkey = b.mr->rkey;
	w.imm_data = htonl(0xa1b2c3d4);
	post(a.qp, &w);
	sent(4, IBV_WC_RDMA_WRITE);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV_RDMA_WITH_IMM);
	CHECK_EQ(wc.wr_id, 1004);
	CHECK(wc.wc_flags & IBV_WC_WITH_IMM);
	CHECK_EQ(wc.imm_data, htonl(0xa1b2c3d4));
	CHECK_EQ(wc.byte_len, 500);
	CHECK_MEM(b.buf + WIMM_DST, a.buf, 500);
	/* Zero bytes, immediate only. */
	post_recv(b.qp, 1005, b.buf, 16, b.mr->lkey);
	w = wr_of(5, IBV_WR_RDMA_WRITE_WITH_IMM, NULL, 0);
	w.wr.rdma.remote_addr = (uintptr_t)b.buf + WIMM_DST;
	w.wr.rdma.rkey = b.mr->rkey;
	w.imm_data = htonl(7);
	post(a.qp, &w);
	sent(5, IBV_WC_RDMA_WRITE);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV_RDMA_WITH_IMM);
	CHECK_EQ(wc.wr_id, 1005);
	CHECK_EQ(wc.imm_data, htonl(7));
	CHECK_EQ(wc.byte_len, 0);
	printf("  RDMA_WRITE_WITH_IMM: 500 bytes and 0 bytes\n");

	/* RDMA_READ of 5000 bytes. */
	fill(b.buf + READ_SRC, 5000, 6);
	memset(a.buf + READ_DST, 0, 5000);
	struct ibv_sge rd = {(uintptr_t)a.buf + READ_DST, 5000, a.mr->lkey};
	w = wr_of(6, IBV_WR_RDMA_READ, &rd, 1);
	w.wr.rdma.remote_addr = (uintptr_t)b.buf + READ_SRC;
	w.wr.rdma.rkey = b.mr->rkey;
	post(a.qp, &w);
	struct ibv_wc rwc;
	EXPECT_WC(a.cq, &rwc, IBV_WC_SUCCESS, IBV_WC_RDMA_READ);
	CHECK_EQ(rwc.wr_id, 6);
	CHECK_EQ(rwc.byte_len, 5000);
	CHECK_MEM(a.buf + READ_DST, b.buf + READ_SRC, 5000);
	printf("  RDMA_READ: 5000 bytes\n");

	/* Atomics on a host-order 64-bit word; the original value comes back. */
	*u64_at(b.buf, ATOMIC) = 0x1111222233334444ull;
	*u64_at(a.buf, ATOMIC) = 0;
	struct ibv_sge at = {(uintptr_t)a.buf + ATOMIC, 8, a.mr->lkey};
	w = wr_of(7, IBV_WR_ATOMIC_CMP_AND_SWP, &at, 1);
	w.wr.atomic.remote_addr = (uintptr_t)b.buf + ATOMIC;
	w.wr.atomic.rkey = b.mr->rkey;
	w.wr.atomic.compare_add = 0x1111222233334444ull;
	w.wr.atomic.swap = 0x5555666677778888ull;
	post(a.qp, &w);
	sent(7, IBV_WC_COMP_SWAP);
	CHECK_EQ(*u64_at(a.buf, ATOMIC), 0x1111222233334444ull);
	CHECK_EQ(*u64_at(b.buf, ATOMIC), 0x5555666677778888ull);
	/* A compare that does not match swaps nothing. */
	w.wr_id = 8;
	w.wr.atomic.compare_add = 1;
	w.wr.atomic.swap = 2;
	post(a.qp, &w);
	sent(8, IBV_WC_COMP_SWAP);
	CHECK_EQ(*u64_at(a.buf, ATOMIC), 0x5555666677778888ull);
	CHECK_EQ(*u64_at(b.buf, ATOMIC), 0x5555666677778888ull);
	w = wr_of(9, IBV_WR_ATOMIC_FETCH_AND_ADD, &at, 1);
	w.wr.atomic.remote_addr = (uintptr_t)b.buf + ATOMIC;
	w.wr.atomic.rkey = b.mr->rkey;
	w.wr.atomic.compare_add = 0x10;
	post(a.qp, &w);
	sent(9, IBV_WC_FETCH_ADD);
	CHECK_EQ(*u64_at(a.buf, ATOMIC), 0x5555666677778888ull);
	CHECK_EQ(*u64_at(b.buf, ATOMIC), 0x5555666677778898ull);
	printf("  atomics: CMP_AND_SWP (hit and miss), FETCH_AND_ADD\n");

	/* Inline SEND and WRITE from a stack buffer overwritten right after the post. */
	{
		uint8_t msg[48], orig[48];
		fill(msg, sizeof(msg), 10);
		memcpy(orig, msg, sizeof(msg));
		post_recv(b.qp, 1010, b.buf, 4096, b.mr->lkey);
		struct ibv_sge is = {(uintptr_t)msg, sizeof(msg), 0 /* no key: inline */};
		w = wr_of(10, IBV_WR_SEND, &is, 1);
		w.send_flags |= IBV_SEND_INLINE;
		post(a.qp, &w);
		memset(msg, 0xee, sizeof(msg));
		w = wr_of(11, IBV_WR_RDMA_WRITE, &is, 1);
		w.send_flags |= IBV_SEND_INLINE;
		w.wr.rdma.remote_addr = (uintptr_t)b.buf + WRITE_DST;
		w.wr.rdma.rkey = b.mr->rkey;
		post(a.qp, &w);
		memset(msg, 0, sizeof(msg));
		sent(10, IBV_WC_SEND);
		sent(11, IBV_WC_RDMA_WRITE);
		EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
		CHECK_EQ(wc.byte_len, sizeof(msg));
		CHECK_MEM(b.buf, orig, sizeof(msg));
		uint8_t ee[48];
		memset(ee, 0xee, sizeof(ee));
		CHECK_MEM(b.buf + WRITE_DST, ee, sizeof(ee));
	}
	printf("  inline: SEND and RDMA_WRITE from a reused stack buffer\n");

	/* Three requests in one post: an unsignaled WRITE, a SEND_WITH_IMM, a READ. */
	fill(a.buf, 2048, 12);
	fill(b.buf + READ_SRC, 700, 13);
	post_recv(b.qp, 1012, b.buf, 4096, b.mr->lkey);
	struct ibv_sge l1 = {(uintptr_t)a.buf, 1500, a.mr->lkey};
	struct ibv_sge l2 = {(uintptr_t)a.buf + 1500, 300, a.mr->lkey};
	struct ibv_sge l3 = {(uintptr_t)a.buf + READ_DST, 700, a.mr->lkey};
	struct ibv_send_wr w1 = wr_of(21, IBV_WR_RDMA_WRITE, &l1, 1);
	struct ibv_send_wr w2 = wr_of(22, IBV_WR_SEND_WITH_IMM, &l2, 1);
	struct ibv_send_wr w3 = wr_of(23, IBV_WR_RDMA_READ, &l3, 1);
	w1.send_flags = 0;
	w1.wr.rdma.remote_addr = (uintptr_t)b.buf + LIST_DST;
	w1.wr.rdma.rkey = b.mr->rkey;
	w2.imm_data = htonl(22);
	w3.wr.rdma.remote_addr = (uintptr_t)b.buf + READ_SRC;
	w3.wr.rdma.rkey = b.mr->rkey;
	w1.next = &w2;
	w2.next = &w3;
	post(a.qp, &w1);
	sent(22, IBV_WC_SEND);
	sent(23, IBV_WC_RDMA_READ);
	EXPECT_NO_WC(a.cq, 20);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 1012);
	CHECK_EQ(wc.byte_len, 300);
	CHECK_EQ(wc.imm_data, htonl(22));
	CHECK_MEM(b.buf + LIST_DST, a.buf, 1500);
	CHECK_MEM(b.buf, a.buf + 1500, 300);
	CHECK_MEM(a.buf + READ_DST, b.buf + READ_SRC, 700);
	printf("  list of 3: unsignaled WRITE, SEND_WITH_IMM, READ\n");

	/* 40 requests in one list, their completions read in batches of up to 64. */
	struct ibv_send_wr many[40];
	struct ibv_sge msge[40];
	for (int i = 0; i < 40; i++) {
		msge[i] = (struct ibv_sge){(uintptr_t)a.buf + 64 * i, 64, a.mr->lkey};
		many[i] = wr_of(100 + i, IBV_WR_RDMA_WRITE, &msge[i], 1);
		many[i].wr.rdma.remote_addr = (uintptr_t)b.buf + LIST_DST + 64 * i;
		many[i].wr.rdma.rkey = b.mr->rkey;
		many[i].next = i < 39 ? &many[i + 1] : NULL;
	}
	fill(a.buf, 64 * 40, 14);
	post(a.qp, &many[0]);
	struct ibv_wc wcs[64];
	int got = 0;
	double end = now_s() + WAIT_S;
	while (got < 40) {
		int n = ibv_poll_cq(a.cq, 64, wcs);
		CHECK(n >= 0 && got + n <= 40);
		for (int i = 0; i < n; i++) {
			CHECK_EQ(wcs[i].status, IBV_WC_SUCCESS);
			CHECK_EQ(wcs[i].opcode, IBV_WC_RDMA_WRITE);
			CHECK_EQ(wcs[i].wr_id, 100 + got + i);
		}
		got += n;
		if (now_s() > end)
			FAIL("%d of 40 completions", got);
	}
	CHECK_MEM(b.buf + LIST_DST, a.buf, 64 * 40);
	printf("  list of 40 WRITEs, completions polled in batches\n");
}

/* The same operations through ibv_wr_*. */
static void builder(void)
{
	struct ibv_qp_ex *qx = ibv_qp_to_qp_ex(a.qp);
	CHECK(qx != NULL);
	struct ibv_wc wc;

	/* SEND with a gather list. */
	fill(a.buf, 4096, 31);
	post_recv(b.qp, 2001, b.buf, 4096, b.mr->lkey);
	struct ibv_sge g[2] = {{(uintptr_t)a.buf, 64, a.mr->lkey},
			       {(uintptr_t)a.buf + 128, 64, a.mr->lkey}};
	ibv_wr_start(qx);
	qx->wr_id = 31;
	qx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send(qx);
	ibv_wr_set_sge_list(qx, 2, g);
	CHECK_RET(ibv_wr_complete(qx), 0);
	sent(31, IBV_WC_SEND);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 2001);
	CHECK_EQ(wc.byte_len, 128);
	CHECK_MEM(b.buf, a.buf, 64);
	CHECK_MEM(b.buf + 64, a.buf + 128, 64);

	/* SEND_WITH_IMM, RDMA_WRITE, RDMA_WRITE_WITH_IMM in one batch. */
	post_recv(b.qp, 2002, b.buf, 4096, b.mr->lkey);
	post_recv(b.qp, 2003, b.buf + 4096, 16, b.mr->lkey);
	ibv_wr_start(qx);
	qx->wr_id = 32;
	qx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send_imm(qx, htonl(0xfeedf00d));
	ibv_wr_set_sge(qx, a.mr->lkey, (uintptr_t)a.buf + 1000, 333);
	qx->wr_id = 33;
	ibv_wr_rdma_write(qx, b.mr->rkey, (uintptr_t)b.buf + WRITE_DST);
	ibv_wr_set_sge(qx, a.mr->lkey, (uintptr_t)a.buf + 2000, 2000);
	qx->wr_id = 34;
	ibv_wr_rdma_write_imm(qx, b.mr->rkey, (uintptr_t)b.buf + WIMM_DST, htonl(34));
	ibv_wr_set_sge(qx, a.mr->lkey, (uintptr_t)a.buf + 100, 40);
	CHECK_RET(ibv_wr_complete(qx), 0);
	sent(32, IBV_WC_SEND);
	sent(33, IBV_WC_RDMA_WRITE);
	sent(34, IBV_WC_RDMA_WRITE);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 2002);
	CHECK_EQ(wc.byte_len, 333);
	CHECK(wc.wc_flags & IBV_WC_WITH_IMM);
	CHECK_EQ(wc.imm_data, htonl(0xfeedf00d));
	CHECK_MEM(b.buf, a.buf + 1000, 333);
	CHECK_MEM(b.buf + WRITE_DST, a.buf + 2000, 2000);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV_RDMA_WITH_IMM);
	CHECK_EQ(wc.wr_id, 2003);
	CHECK_EQ(wc.imm_data, htonl(34));
	CHECK_EQ(wc.byte_len, 40);
	CHECK_MEM(b.buf + WIMM_DST, a.buf + 100, 40);

	/* RDMA_READ and both atomics. */
	fill(b.buf + READ_SRC, 3333, 35);
	memset(a.buf + READ_DST, 0, 3333);
	*u64_at(b.buf, ATOMIC) = 100;
	ibv_wr_start(qx);
	qx->wr_id = 35;
	qx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_read(qx, b.mr->rkey, (uintptr_t)b.buf + READ_SRC);
	ibv_wr_set_sge(qx, a.mr->lkey, (uintptr_t)a.buf + READ_DST, 3333);
	qx->wr_id = 36;
	ibv_wr_atomic_cmp_swp(qx, b.mr->rkey, (uintptr_t)b.buf + ATOMIC, 100, 200);
	ibv_wr_set_sge(qx, a.mr->lkey, (uintptr_t)a.buf + ATOMIC, 8);
	qx->wr_id = 37;
	ibv_wr_atomic_fetch_add(qx, b.mr->rkey, (uintptr_t)b.buf + ATOMIC, 5);
	ibv_wr_set_sge(qx, a.mr->lkey, (uintptr_t)a.buf + ATOMIC + 8, 8);
	CHECK_RET(ibv_wr_complete(qx), 0);
	sent(35, IBV_WC_RDMA_READ);
	sent(36, IBV_WC_COMP_SWAP);
	sent(37, IBV_WC_FETCH_ADD);
	CHECK_MEM(a.buf + READ_DST, b.buf + READ_SRC, 3333);
	CHECK_EQ(*u64_at(a.buf, ATOMIC), 100);
	CHECK_EQ(*u64_at(a.buf, ATOMIC + 8), 200);
	CHECK_EQ(*u64_at(b.buf, ATOMIC), 205);

	/* ATOMIC WRITE: eight bytes from the caller's (unaligned, reused) buffer, stored whole;
	 * a misaligned target or a NULL value is refused at ibv_wr_complete, posting nothing. */
	{
		uint8_t val[9] = {0, 0xa1, 0xa2, 0xa3, 0xa4, 0xa5, 0xa6, 0xa7, 0xa8};
		*u64_at(b.buf, ATOMIC + 16) = 0;
		*u64_at(b.buf, ATOMIC + 24) = 0x0102030405060708ull;
		ibv_wr_start(qx);
		qx->wr_id = 38;
		qx->wr_flags = IBV_SEND_SIGNALED;
		ibv_wr_atomic_write(qx, b.mr->rkey, (uintptr_t)b.buf + ATOMIC + 16, val + 1);
		CHECK_RET(ibv_wr_complete(qx), 0);
		memset(val, 0, sizeof(val));
		sent(38, IBV_WC_ATOMIC_WRITE);
		static const uint8_t want[8] = {0xa1, 0xa2, 0xa3, 0xa4, 0xa5, 0xa6, 0xa7, 0xa8};
		CHECK_MEM(b.buf + ATOMIC + 16, want, 8);
		CHECK_EQ(*u64_at(b.buf, ATOMIC + 24), 0x0102030405060708ull);
		ibv_wr_start(qx);
		qx->wr_id = 39;
		ibv_wr_atomic_write(qx, b.mr->rkey, (uintptr_t)b.buf + ATOMIC + 20, want);
		CHECK(ibv_wr_complete(qx) != 0);
		ibv_wr_start(qx);
		ibv_wr_atomic_write(qx, b.mr->rkey, (uintptr_t)b.buf + ATOMIC + 16, NULL);
		CHECK(ibv_wr_complete(qx) != 0);
		EXPECT_NO_WC(a.cq, 20);
		CHECK_MEM(b.buf + ATOMIC + 16, want, 8);
	}

	/* Inline data, single and list, from a stack buffer reused at once. */
	{
		uint8_t msg[40], orig[40];
		fill(msg, sizeof(msg), 38);
		memcpy(orig, msg, sizeof(msg));
		post_recv(b.qp, 2038, b.buf, 4096, b.mr->lkey);
		post_recv(b.qp, 2039, b.buf + 4096, 4096, b.mr->lkey);
		ibv_wr_start(qx);
		qx->wr_id = 38;
		qx->wr_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
		ibv_wr_send(qx);
		ibv_wr_set_inline_data(qx, msg, sizeof(msg));
		memset(msg, 0, sizeof(msg));
		uint8_t p1[5] = {1, 2, 3, 4, 5}, p2[3] = {6, 7, 8};
		struct ibv_data_buf parts[2] = {{p1, sizeof(p1)}, {p2, sizeof(p2)}};
		qx->wr_id = 39;
		ibv_wr_send(qx);
		ibv_wr_set_inline_data_list(qx, 2, parts);
		memset(p1, 0, sizeof(p1));
		CHECK_RET(ibv_wr_complete(qx), 0);
		sent(38, IBV_WC_SEND);
		sent(39, IBV_WC_SEND);
		EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
		CHECK_EQ(wc.byte_len, sizeof(orig));
		CHECK_MEM(b.buf, orig, sizeof(orig));
		EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
		CHECK_EQ(wc.byte_len, 8);
		static const uint8_t joined[8] = {1, 2, 3, 4, 5, 6, 7, 8};
		CHECK_MEM(b.buf + 4096, joined, 8);
	}

	/* An aborted batch posts nothing; an unsignaled request completes silently. */
	ibv_wr_start(qx);
	qx->wr_id = 40;
	qx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(qx, b.mr->rkey, (uintptr_t)b.buf + WRITE_DST);
	ibv_wr_set_sge(qx, a.mr->lkey, (uintptr_t)a.buf, 8);
	ibv_wr_abort(qx);
	ibv_wr_start(qx);
	qx->wr_id = 41;
	qx->wr_flags = 0;
	ibv_wr_rdma_write(qx, b.mr->rkey, (uintptr_t)b.buf + WRITE_DST);
	ibv_wr_set_sge(qx, a.mr->lkey, (uintptr_t)a.buf, 8);
	qx->wr_id = 42;
	qx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(qx, b.mr->rkey, (uintptr_t)b.buf + WRITE_DST);
	ibv_wr_set_sge(qx, a.mr->lkey, (uintptr_t)a.buf, 8);
	CHECK_RET(ibv_wr_complete(qx), 0);
	sent(42, IBV_WC_RDMA_WRITE);
	EXPECT_NO_WC(a.cq, 20);

	/* ibv_post_send works on an extended QP too. */
	post_recv(b.qp, 2043, b.buf, 4096, b.mr->lkey);
	post_send_buf(a.qp, 43, a.buf, 16, a.mr->lkey);
	sent(43, IBV_WC_SEND);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 2043);
	printf("  ibv_wr_*: every opcode, SGE lists, inline lists, abort, unsignaled\n");
}

/* A QP built for SENDs only refuses a WRITE at ibv_wr_complete, posting nothing. */
static void builder_limits(void)
{
	struct ibv_qp_init_attr_ex ax = {
		.send_cq = a.cq,
		.recv_cq = a.cq,
		.cap = {.max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1,
			.max_inline_data = 16},
		.qp_type = IBV_QPT_RC,
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
		.pd = a.pd,
		.send_ops_flags = IBV_QP_EX_WITH_SEND,
	};
	struct ibv_qp *qp = ibv_create_qp_ex(a.ctx, &ax);
	CHECK(qp != NULL);
	struct qp_opts o = default_qp_opts();
	struct ibv_qp_init_attr pi = {
		.send_cq = b.cq,
		.recv_cq = b.cq,
		.cap = {.max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1},
		.qp_type = IBV_QPT_RC,
	};
	struct ibv_qp *peer = ibv_create_qp(b.pd, &pi);
	CHECK(peer != NULL);
	qp_connect(qp, peer->qp_num, &b.gid, &o);
	qp_connect(peer, qp->qp_num, &a.gid, &o);
	struct ibv_qp_ex *qx = ibv_qp_to_qp_ex(qp);
	CHECK(qx != NULL);
	ibv_wr_start(qx);
	qx->wr_id = 50;
	qx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(qx, b.mr->rkey, (uintptr_t)b.buf);
	ibv_wr_set_sge(qx, a.mr->lkey, (uintptr_t)a.buf, 8);
	CHECK(ibv_wr_complete(qx) != 0);
	ibv_wr_start(qx);
	ibv_wr_atomic_write(qx, b.mr->rkey, (uintptr_t)b.buf, a.buf);
	CHECK(ibv_wr_complete(qx) != 0);
	/* Too much inline data, too many SGEs. */
	uint8_t big[64] = {0};
	ibv_wr_start(qx);
	qx->wr_id = 51;
	ibv_wr_send(qx);
	ibv_wr_set_inline_data(qx, big, sizeof(big));
	CHECK(ibv_wr_complete(qx) != 0);
	struct ibv_sge two[2] = {{(uintptr_t)a.buf, 8, a.mr->lkey},
				 {(uintptr_t)a.buf + 8, 8, a.mr->lkey}};
	ibv_wr_start(qx);
	qx->wr_id = 52;
	ibv_wr_send(qx);
	ibv_wr_set_sge_list(qx, 2, two);
	CHECK(ibv_wr_complete(qx) != 0);
	EXPECT_NO_WC(a.cq, 50);
	/* A good one still goes. */
	post_recv(peer, 3053, b.buf, 64, b.mr->lkey);
	ibv_wr_start(qx);
	qx->wr_id = 53;
	qx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send(qx);
	ibv_wr_set_sge(qx, a.mr->lkey, (uintptr_t)a.buf, 8);
	CHECK_RET(ibv_wr_complete(qx), 0);
	struct ibv_wc wc;
	EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	CHECK_EQ(wc.wr_id, 53);
	EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 3053);
	CHECK_RET(ibv_destroy_qp(qp), 0);
	CHECK_RET(ibv_destroy_qp(peer), 0);
	printf("  ibv_wr_* refusals: op not enabled, inline too long, too many SGEs\n");
}

int main(void)
{
	struct qp_opts o = default_qp_opts();
	pair_open(&a, &b, 0, 1 << 16, 64, &o);
	classic();
	CHECK_RET(ibv_destroy_qp(a.qp), 0);
	CHECK_RET(ibv_destroy_qp(b.qp), 0);
	/* Again with the builder, on new QPs made with ibv_create_qp_ex. */
	o.ex = 1;
	o.more_send_ops = IBV_QP_EX_WITH_ATOMIC_WRITE;
	side_qp(&a, &o);
	side_qp(&b, &o);
	sides_connect(&a, &o, &b, &o);
	builder();
	builder_limits();
	/* And the classic operations between two QPs of one NIC. */
	side_close(&b);
	side_open(&b, "rb0", 1 << 16, 64);
	CHECK_RET(ibv_destroy_qp(a.qp), 0);
	o.ex = 0;
	side_qp(&a, &o);
	side_qp(&b, &o);
	sides_connect(&a, &o, &b, &o);
	printf(" loopback on rb0:\n");
	classic();
	side_close(&a);
	side_close(&b);
	printf("qp_ops: ok\n");
	return 0;
}
