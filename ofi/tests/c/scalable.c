/* scalable.c: scalable endpoints (fi_scalable_ep(3), fi_endpoint(3)) on RDM endpoints.
 *
 * The offer for hints asking several contexts and FI_NAMED_RX_CTX (RDM only, up to
 * max_ep_tx_ctx), a scalable endpoint of three transmit and three receive contexts on rb0
 * and one on rb1: every transmit context sends to every receive context of the other,
 * named with fi_rx_addr, each message landing on the receive context it names, in order;
 * an ordinary endpoint sends to a named receive context and replies to a transmit
 * context's message (the reply goes to receive context 0, not back over the transmit
 * context's connection); tagged messages (eager and rendezvous) to a named receive
 * context; and the refusals: contexts beyond the count or opened twice, a
 * receive on a transmit context, a send on a receive context or on the scalable endpoint
 * itself, bindings other than the AV, closing the scalable endpoint before its contexts.
 */
#include "ctest.h"

#define NCTX 3

struct sep_side {
	struct fid_domain *dom;
	struct fid_av *av;
	struct fid_ep *sep, *tx[NCTX], *rx[NCTX];
	struct fid_cq *txcq[NCTX], *rxcq[NCTX];
	char name[64];
	size_t namelen;
};

static void sep_open(struct fid_fabric *fab, struct fi_info *info, struct sep_side *s, int bits)
{
	struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_TAGGED, .size = 64};
	struct fi_av_attr av_attr = {.type = FI_AV_TABLE, .rx_ctx_bits = bits};
	REQUIRE(fi_domain(fab, info, &s->dom, NULL) == 0);
	REQUIRE(fi_av_open(s->dom, &av_attr, &s->av, NULL) == 0);
	REQUIRE(fi_scalable_ep(s->dom, info, &s->sep, (void *)0x5e) == 0);
	CHECK(s->sep->fid.fclass == FI_CLASS_SEP && s->sep->fid.context == (void *)0x5e);
	for (int i = 0; i < NCTX; i++) {
		REQUIRE(fi_tx_context(s->sep, i, NULL, &s->tx[i], (void *)(uintptr_t)(0x70 + i)) ==
			0);
		CHECK(s->tx[i]->fid.fclass == FI_CLASS_TX_CTX);
		REQUIRE(fi_rx_context(s->sep, i, NULL, &s->rx[i], NULL) == 0);
		CHECK(s->rx[i]->fid.fclass == FI_CLASS_RX_CTX);
		REQUIRE(fi_cq_open(s->dom, &cq_attr, &s->txcq[i], NULL) == 0);
		REQUIRE(fi_cq_open(s->dom, &cq_attr, &s->rxcq[i], NULL) == 0);
	}
	/* A context beyond the count, or one already open: refused. */
	struct fid_ep *no = NULL;
	CHECK_EQ(fi_tx_context(s->sep, NCTX, NULL, &no, NULL), -FI_EINVAL);
	CHECK_EQ(fi_rx_context(s->sep, -1, NULL, &no, NULL), -FI_EINVAL);
	CHECK_EQ(fi_tx_context(s->sep, 0, NULL, &no, NULL), -FI_EINVAL);
	CHECK_EQ(fi_rx_context(s->sep, 1, NULL, &no, NULL), -FI_EINVAL);
	/* A scalable endpoint takes its AV, nothing else; a context anything but an AV. */
	CHECK_EQ(fi_scalable_ep_bind(s->sep, &s->txcq[0]->fid, FI_TRANSMIT), -FI_EINVAL);
	CHECK_EQ(fi_ep_bind(s->tx[0], &s->av->fid, 0), -FI_EINVAL);
	REQUIRE(fi_scalable_ep_bind(s->sep, &s->av->fid, 0) == 0);
	for (int i = 0; i < NCTX; i++) {
		/* A transmit context needs its CQ (and no receive CQ). */
		CHECK_EQ(fi_enable(s->tx[i]), -FI_ENOCQ);
		REQUIRE(fi_ep_bind(s->tx[i], &s->txcq[i]->fid, FI_TRANSMIT) == 0);
		REQUIRE(fi_enable(s->tx[i]) == 0);
		REQUIRE(fi_ep_bind(s->rx[i], &s->rxcq[i]->fid, FI_RECV) == 0);
		REQUIRE(fi_enable(s->rx[i]) == 0);
	}
	REQUIRE(fi_enable(s->sep) == 0);
	s->namelen = sizeof(s->name);
	REQUIRE(fi_getname(&s->sep->fid, s->name, &s->namelen) == 0);
	/* A context has its endpoint's address. */
	char ctx_name[64];
	size_t ctx_len = sizeof(ctx_name);
	REQUIRE(fi_getname(&s->rx[1]->fid, ctx_name, &ctx_len) == 0);
	CHECK(ctx_len == s->namelen && memcmp(ctx_name, s->name, ctx_len) == 0);
}

static void sep_close(struct sep_side *s)
{
	/* Not before its contexts. */
	CHECK_EQ(fi_close(&s->sep->fid), -FI_EBUSY);
	for (int i = 0; i < NCTX; i++) {
		CHECK_EQ(fi_close(&s->tx[i]->fid), 0);
		CHECK_EQ(fi_close(&s->rx[i]->fid), 0);
		CHECK_EQ(fi_close(&s->txcq[i]->fid), 0);
		CHECK_EQ(fi_close(&s->rxcq[i]->fid), 0);
	}
	CHECK_EQ(fi_close(&s->sep->fid), 0);
	CHECK_EQ(fi_close(&s->av->fid), 0);
	CHECK_EQ(fi_close(&s->dom->fid), 0);
}

static void offers(void)
{
	struct fi_info *h = ct_hints(FI_MSG | FI_NAMED_RX_CTX, 1), *list = NULL, *none = NULL;
	h->ep_attr->tx_ctx_cnt = 4;
	h->ep_attr->rx_ctx_cnt = 2;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list) == 0);
	CHECK(list->caps & FI_NAMED_RX_CTX);
	CHECK_EQ(list->ep_attr->tx_ctx_cnt, 4);
	CHECK_EQ(list->ep_attr->rx_ctx_cnt, 2);
	CHECK(list->domain_attr->max_ep_tx_ctx >= NCTX && list->domain_attr->max_ep_rx_ctx >= NCTX);
	/* More contexts than an endpoint has: no offer. */
	h->ep_attr->tx_ctx_cnt = list->domain_attr->max_ep_tx_ctx + 1;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &none), -FI_ENODATA);
	/* Datagram and connected endpoints are not scalable. */
	h->ep_attr->tx_ctx_cnt = 2;
	h->caps = FI_MSG;
	h->ep_attr->type = FI_EP_DGRAM;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &none), -FI_ENODATA);
	h->ep_attr->type = FI_EP_MSG;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &none), -FI_ENODATA);
	h->caps = FI_MSG | FI_NAMED_RX_CTX;
	h->ep_attr->tx_ctx_cnt = 0;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &none), -FI_ENODATA);
	fi_freeinfo(h);
	fi_freeinfo(list);
}

int main(void)
{
	ct_name = "scalable";
	offers();

	struct fi_info *h = ct_hints(FI_MSG | FI_TAGGED | FI_NAMED_RX_CTX, 1), *list = NULL;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list) == 0);
	fi_freeinfo(h);
	REQUIRE(list && list->next);
	struct fid_fabric *fab;
	REQUIRE(fi_fabric(list->fabric_attr, &fab, NULL) == 0);
	for (struct fi_info *i = list; i; i = i->next)
		i->ep_attr->tx_ctx_cnt = i->ep_attr->rx_ctx_cnt = NCTX;
	/* Too many contexts for fi_scalable_ep itself. */
	struct fid_domain *d0;
	struct fid_ep *no = NULL;
	REQUIRE(fi_domain(fab, list, &d0, NULL) == 0);
	list->ep_attr->rx_ctx_cnt = list->domain_attr->max_ep_rx_ctx + 1;
	CHECK_EQ(fi_scalable_ep(d0, list, &no, NULL), -FI_EINVAL);
	list->ep_attr->rx_ctx_cnt = NCTX;
	CHECK_EQ(fi_close(&d0->fid), 0);

	/* Two bits name a receive context: 3 contexts. */
	int bits = 2;
	struct sep_side a, b;
	sep_open(fab, list, &a, bits);
	sep_open(fab, list->next, &b, bits);
	fi_addr_t a_b, b_a;
	REQUIRE(fi_av_insert(a.av, b.name, 1, &a_b, 0, NULL) == 1);
	REQUIRE(fi_av_insert(b.av, a.name, 1, &b_a, 0, NULL) == 1);

	char *abuf = ct_pages(1 << 16), *bbuf = ct_pages(1 << 16);
	struct fid_mr *amr, *bmr;
	REQUIRE(fi_mr_reg(a.dom, abuf, 1 << 16, FI_SEND | FI_RECV, 0, 0, 0, &amr, NULL) == 0);
	REQUIRE(fi_mr_reg(b.dom, bbuf, 1 << 16, FI_SEND | FI_RECV, 0, 0, 0, &bmr, NULL) == 0);

	/* Neither the scalable endpoint nor the wrong kind of context moves data. */
	CHECK_EQ(fi_send(a.sep, abuf, 8, fi_mr_desc(amr), a_b, NULL), -FI_ENOSYS);
	CHECK_EQ(fi_recv(a.sep, abuf, 8, fi_mr_desc(amr), FI_ADDR_UNSPEC, NULL), -FI_ENOSYS);
	CHECK_EQ(fi_recv(a.tx[0], abuf, 8, fi_mr_desc(amr), FI_ADDR_UNSPEC, NULL), -FI_ENOSYS);
	CHECK_EQ(fi_send(a.rx[0], abuf, 8, fi_mr_desc(amr), a_b, NULL), -FI_ENOSYS);
	CHECK_EQ(fi_tsend(a.rx[0], abuf, 8, fi_mr_desc(amr), a_b, 1, NULL), -FI_ENOSYS);

	/* Each receive context gets 2 * NCTX receives of 512 bytes. */
	for (int j = 0; j < NCTX; j++)
		for (int k = 0; k < 2 * NCTX; k++)
			CHECK_EQ(fi_recv(b.rx[j], bbuf + 512 * (j * 2 * NCTX + k), 512,
					 fi_mr_desc(bmr), FI_ADDR_UNSPEC,
					 (void *)(uintptr_t)(0x100 * (j + 1) + k)),
				 0);
	int n = 0;
	for (int round = 0; round < 2; round++)
		for (int i = 0; i < NCTX; i++)
			for (int j = 0; j < NCTX; j++) {
				/* Message (round, i, j): 100 + 10 j + i bytes, pattern i * 16 + j. */
				char *p = abuf + 512 * n++;
				unsigned seed = (unsigned)(round * 64 + i * 8 + j);
				ct_fill(p, 100 + 10 * j + i, seed);
				CHECK_EQ(fi_send(a.tx[i], p, 100 + 10 * j + i, fi_mr_desc(amr),
						 fi_rx_addr(a_b, j, bits),
						 (void *)(uintptr_t)(0x1000 + seed)),
					 0);
			}
	struct fi_cq_tagged_entry e;
	/* Each transmit context completes its own sends (to three connections: in no
	 * promised order), each once. */
	for (int i = 0; i < NCTX; i++) {
		int seen[2][NCTX] = {{0}};
		for (int k = 0; k < 2 * NCTX; k++) {
			if (!ct_wait(a.txcq[i], &e)) {
				CHECK(!"a send completion");
				continue;
			}
			CHECK_EQ(e.flags, FI_SEND | FI_MSG);
			unsigned seed = (unsigned)((uintptr_t)e.op_context - 0x1000);
			int round = (int)(seed / 64), from = (int)(seed / 8 % 8), j = (int)(seed % 8);
			if (round > 1 || from != i || j >= NCTX || seen[round][j]++) {
				CHECK(!"a send of this context, completed once");
				continue;
			}
		}
	}
	/* Each receive context takes the messages named for it: from every transmit context,
	 * each one's in order. */
	for (int j = 0; j < NCTX; j++) {
		int next[NCTX] = {0};
		for (int k = 0; k < 2 * NCTX; k++) {
			if (!ct_wait(b.rxcq[j], &e)) {
				CHECK(!"a receive completion");
				continue;
			}
			CHECK(e.op_context == (void *)(uintptr_t)(0x100 * (j + 1) + k));
			CHECK_EQ(e.flags, FI_RECV | FI_MSG);
			int i = (int)e.len - 100 - 10 * j;
			if (i < 0 || i >= NCTX) {
				CHECK(!"a message of a length sent to this context");
				continue;
			}
			unsigned seed = (unsigned)(next[i]++ * 64 + i * 8 + j);
			CHECK(ct_same(bbuf + 512 * (j * 2 * NCTX + k), e.len, seed));
		}
		CHECK(ct_quiet(b.rxcq[j]));
	}
	for (int i = 0; i < NCTX; i++)
		CHECK(ct_quiet(a.txcq[i]));

	/* Tagged messages to a named receive context: an eager one and a rendezvous. */
	char *big = ct_pages(1 << 20), *bigin = ct_pages(1 << 20);
	ct_fill(big, 1 << 20, 9);
	ct_fill(abuf + 20000, 64, 8);
	CHECK_EQ(fi_trecv(b.rx[1], bbuf + 20000, 64, fi_mr_desc(bmr), FI_ADDR_UNSPEC, 0x77, 0,
			  (void *)0x71),
		 0);
	CHECK_EQ(fi_trecv(b.rx[1], bigin, 1 << 20, NULL, FI_ADDR_UNSPEC, 0x78, 0, (void *)0x72), 0);
	CHECK_EQ(fi_tsend(a.tx[2], abuf + 20000, 64, fi_mr_desc(amr), fi_rx_addr(a_b, 1, bits), 0x77,
			  (void *)0x61),
		 0);
	CHECK_EQ(fi_tsend(a.tx[2], big, 1 << 20, NULL, fi_rx_addr(a_b, 1, bits), 0x78, (void *)0x62),
		 0);
	CHECK(ct_wait(b.rxcq[1], &e) && e.op_context == (void *)0x71 && e.tag == 0x77 &&
	      e.len == 64 && ct_same(bbuf + 20000, 64, 8));
	CHECK(ct_wait(b.rxcq[1], &e) && e.op_context == (void *)0x72 && e.tag == 0x78 &&
	      e.len == 1 << 20 && ct_same(bigin, 1 << 20, 9));
	CHECK(ct_wait(a.txcq[2], &e) && e.op_context == (void *)0x61);
	CHECK(ct_wait(a.txcq[2], &e) && e.op_context == (void *)0x62);
	CHECK(ct_quiet(b.rxcq[0]) && ct_quiet(b.rxcq[2]));

	/* A context beyond B's: the connection is refused, the send fails. */
	CHECK_EQ(fi_send(a.tx[0], abuf, 8, fi_mr_desc(amr), fi_rx_addr(a_b, 3, bits), (void *)0xbad),
		 0);
	struct fi_cq_err_entry err;
	if (ct_wait_err(a.txcq[0], &err))
		CHECK(err.op_context == (void *)0xbad && err.err != 0);
	else
		CHECK(!"an error completion for a context that does not exist");

	/* An ordinary endpoint of rb1 (AV with rx_ctx_bits too) sends to A's receive context 2,
	 * and answers a message from A's transmit context 1: the answer reaches A's receive
	 * context 0. */
	struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_TAGGED, .size = 64};
	struct fi_av_attr av_attr = {.type = FI_AV_TABLE, .rx_ctx_bits = bits};
	struct fid_av *oav;
	struct fid_cq *ocq;
	struct fid_ep *oep;
	list->next->ep_attr->tx_ctx_cnt = 1;
	list->next->ep_attr->rx_ctx_cnt = 1;
	REQUIRE(fi_av_open(b.dom, &av_attr, &oav, NULL) == 0);
	REQUIRE(fi_cq_open(b.dom, &cq_attr, &ocq, NULL) == 0);
	REQUIRE(fi_endpoint(b.dom, list->next, &oep, NULL) == 0);
	REQUIRE(fi_ep_bind(oep, &oav->fid, 0) == 0);
	REQUIRE(fi_ep_bind(oep, &ocq->fid, FI_TRANSMIT | FI_RECV) == 0);
	REQUIRE(fi_enable(oep) == 0);
	char oname[64];
	size_t olen = sizeof(oname);
	REQUIRE(fi_getname(&oep->fid, oname, &olen) == 0);
	fi_addr_t o_a, a_o;
	REQUIRE(fi_av_insert(oav, a.name, 1, &o_a, 0, NULL) == 1);
	REQUIRE(fi_av_insert(a.av, oname, 1, &a_o, 0, NULL) == 1);
	char *in0 = abuf + 40000, *in2 = abuf + 41000, *oin = bbuf + 40000;
	CHECK_EQ(fi_recv(a.rx[0], in0, 512, fi_mr_desc(amr), FI_ADDR_UNSPEC, (void *)0xa0), 0);
	CHECK_EQ(fi_recv(a.rx[2], in2, 512, fi_mr_desc(amr), FI_ADDR_UNSPEC, (void *)0xa2), 0);
	CHECK_EQ(fi_recv(oep, oin, 512, fi_mr_desc(bmr), FI_ADDR_UNSPEC, (void *)0x0e), 0);
	ct_fill(abuf + 42000, 33, 1);
	CHECK_EQ(fi_send(a.tx[1], abuf + 42000, 33, fi_mr_desc(amr), a_o, (void *)0x51), 0);
	CHECK(ct_wait(a.txcq[1], &e) && e.op_context == (void *)0x51);
	CHECK(ct_wait(ocq, &e) && e.op_context == (void *)0x0e && e.len == 33 &&
	      ct_same(oin, 33, 1));
	ct_fill(bbuf + 42000, 44, 2);
	CHECK_EQ(fi_send(oep, bbuf + 42000, 44, fi_mr_desc(bmr), o_a, (void *)0x52), 0);
	ct_fill(bbuf + 43000, 55, 3);
	CHECK_EQ(fi_send(oep, bbuf + 43000, 55, fi_mr_desc(bmr), fi_rx_addr(o_a, 2, bits),
			 (void *)0x53),
		 0);
	CHECK(ct_wait(ocq, &e));
	CHECK(ct_wait(ocq, &e));
	CHECK(ct_wait(a.rxcq[0], &e) && e.op_context == (void *)0xa0 && e.len == 44 &&
	      ct_same(in0, 44, 2));
	CHECK(ct_wait(a.rxcq[2], &e) && e.op_context == (void *)0xa2 && e.len == 55 &&
	      ct_same(in2, 55, 3));
	CHECK(ct_quiet(ocq));
	CHECK_EQ(fi_close(&oep->fid), 0);
	CHECK_EQ(fi_close(&ocq->fid), 0);
	CHECK_EQ(fi_close(&oav->fid), 0);

	CHECK_EQ(fi_close(&amr->fid), 0);
	CHECK_EQ(fi_close(&bmr->fid), 0);
	sep_close(&a);
	sep_close(&b);
	CHECK_EQ(fi_close(&fab->fid), 0);
	fi_freeinfo(list);
	return ct_summary_exit();
}
