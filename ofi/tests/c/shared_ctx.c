/* shared_ctx.c: shared contexts (fi_endpoint(3)).
 *
 * Transmit (fi_stx_context): the offer for hints asking tx_ctx_cnt = FI_SHARED_CONTEXT, the
 * context's refusals, and two endpoints of rb0 bound to one context sending to rb1, each
 * with its own completions, in order.
 *
 * Receive (fi_srx_context): the offer for rx_ctx_cnt = FI_SHARED_CONTEXT (untagged
 * messages, RDM, connected and datagram endpoints), the context's refusals, and two
 * endpoints of rb1 bound to one context: receives posted to the context take the messages
 * sent to either, each exactly once. The same with datagram endpoints, whose address
 * changes when they are bound (their UD QP is made anew on the context's SRQ), and a
 * context that takes the receives of one kind of endpoint refusing the other.
 */
#include "ctest.h"

/* The fabric of `list` and a domain on each of its first two NICs (rb0, rb1). */
static void open_pair(struct fi_info *list, struct fid_fabric **fab, struct fid_domain **da,
		      struct fid_domain **db)
{
	REQUIRE(fi_fabric(list->fabric_attr, fab, NULL) == 0);
	REQUIRE(fi_domain(*fab, list, da, NULL) == 0);
	REQUIRE(fi_domain(*fab, list->next, db, NULL) == 0);
}

static void close_pair(struct fi_info *list, struct fid_fabric *fab, struct fid_domain *da,
		       struct fid_domain *db)
{
	CHECK_EQ(fi_close(&da->fid), 0);
	CHECK_EQ(fi_close(&db->fid), 0);
	CHECK_EQ(fi_close(&fab->fid), 0);
	fi_freeinfo(list);
}

/* Shared receive contexts. */
static void shared_rx(void)
{
	struct fi_info *h = ct_hints(FI_MSG, 1), *list = NULL, *none = NULL;
	h->ep_attr->rx_ctx_cnt = FI_SHARED_CONTEXT;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list) == 0);
	REQUIRE(list && list->next);
	CHECK_EQ(list->ep_attr->rx_ctx_cnt, FI_SHARED_CONTEXT);
	CHECK_EQ(list->caps & FI_TAGGED, 0);
	h->caps = FI_MSG | FI_TAGGED;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &none), -FI_ENODATA);
	h->caps = FI_MSG;
	h->ep_attr->type = FI_EP_DGRAM;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &none) == 0);
	CHECK_EQ(none->ep_attr->rx_ctx_cnt, FI_SHARED_CONTEXT);
	fi_freeinfo(none);
	fi_freeinfo(h);

	struct fid_fabric *fab = NULL;
	struct fid_domain *da = NULL, *db = NULL;
	open_pair(list, &fab, &da, &db);
	struct fid_ep *srx = NULL, *other = NULL;
	struct fi_rx_attr tagged = *list->rx_attr;
	tagged.caps |= FI_TAGGED;
	CHECK_EQ(fi_srx_context(db, &tagged, &srx, NULL), -FI_EINVAL);
	CHECK_EQ(fi_srx_context(db, list->next->rx_attr, NULL, NULL), -FI_EINVAL);
	REQUIRE(fi_srx_context(db, list->next->rx_attr, &srx, (void *)0x5e) == 0);
	CHECK(srx->fid.fclass == FI_CLASS_SRX_CTX && srx->fid.context == (void *)0x5e);
	REQUIRE(fi_srx_context(da, NULL, &other, NULL) == 0);

	struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_TAGGED, .size = 64};
	struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
	struct fid_cq *cqa, *cqb;
	struct fid_av *ava, *avb;
	struct fid_ep *ea, *eb[2];
	REQUIRE(fi_av_open(da, &av_attr, &ava, NULL) == 0);
	REQUIRE(fi_av_open(db, &av_attr, &avb, NULL) == 0);
	REQUIRE(fi_cq_open(da, &cq_attr, &cqa, NULL) == 0);
	REQUIRE(fi_cq_open(db, &cq_attr, &cqb, NULL) == 0);
	REQUIRE(fi_endpoint(da, list, &ea, NULL) == 0);
	REQUIRE(fi_ep_bind(ea, &ava->fid, 0) == 0);
	REQUIRE(fi_ep_bind(ea, &cqa->fid, FI_TRANSMIT | FI_RECV) == 0);
	REQUIRE(fi_enable(ea) == 0);
	fi_addr_t to_b[2];
	for (int i = 0; i < 2; i++) {
		REQUIRE(fi_endpoint(db, list->next, &eb[i], NULL) == 0);
		REQUIRE(fi_ep_bind(eb[i], &avb->fid, 0) == 0);
		REQUIRE(fi_ep_bind(eb[i], &cqb->fid, FI_TRANSMIT | FI_RECV) == 0);
		/* Another domain's context, or an endpoint that is no context: refused. */
		CHECK_EQ(fi_ep_bind(eb[i], &other->fid, 0), -FI_EINVAL);
		CHECK_EQ(fi_ep_bind(eb[i], &ea->fid, 0), -FI_EINVAL);
		REQUIRE(fi_ep_bind(eb[i], &srx->fid, 0) == 0);
		REQUIRE(fi_enable(eb[i]) == 0);
		char name[64];
		size_t len = sizeof(name);
		REQUIRE(fi_getname(&eb[i]->fid, name, &len) == 0);
		REQUIRE(fi_av_insert(ava, name, 1, &to_b[i], 0, NULL) == 1);
	}
	CHECK_EQ(fi_close(&srx->fid), -FI_EBUSY);

	char *abuf = ct_pages(1 << 16), *bbuf = ct_pages(1 << 16);
	struct fid_mr *amr, *bmr;
	REQUIRE(fi_mr_reg(da, abuf, 1 << 16, FI_SEND | FI_RECV, 0, 0, 0, &amr, NULL) == 0);
	REQUIRE(fi_mr_reg(db, bbuf, 1 << 16, FI_SEND | FI_RECV, 0, 0, 0, &bmr, NULL) == 0);
	/* Receives go to the context, not to its endpoints. */
	CHECK(fi_recv(eb[0], bbuf, 64, fi_mr_desc(bmr), FI_ADDR_UNSPEC, NULL) < 0);
	for (int k = 0; k < 8; k++)
		CHECK_EQ(fi_recv(srx, bbuf + 4096 * k, 4096, fi_mr_desc(bmr), FI_ADDR_UNSPEC,
				 (void *)(uintptr_t)(0xb0 + k)),
			 0);
	/* Four messages to each endpoint of B. */
	for (int k = 0; k < 8; k++) {
		ct_fill(abuf + 4096 * k, 2000 + k, 80 + k);
		CHECK_EQ(fi_send(ea, abuf + 4096 * k, 2000 + k, fi_mr_desc(amr), to_b[k % 2],
				 (void *)(uintptr_t)(0xa0 + k)),
			 0);
	}
	struct fi_cq_tagged_entry e;
	/* Every send completes once (sends to two endpoints: in no promised order). */
	int sent[8] = {0};
	for (int k = 0; k < 8; k++) {
		if (!ct_wait(cqa, &e)) {
			CHECK(!"a send completion");
			break;
		}
		int i = (int)((uintptr_t)e.op_context - 0xa0);
		REQUIRE(i >= 0 && i < 8);
		CHECK(!sent[i]);
		sent[i] = 1;
	}
	int seen[8] = {0}, used[8] = {0};
	for (int k = 0; k < 8; k++) {
		if (!ct_wait(cqb, &e)) {
			CHECK(!"a receive of the shared context");
			break;
		}
		int r = (int)((uintptr_t)e.op_context - 0xb0), s = (int)e.len - 2000;
		REQUIRE(r >= 0 && r < 8 && s >= 0 && s < 8);
		CHECK(e.flags & FI_RECV);
		CHECK(!seen[s] && !used[r]);
		seen[s] = used[r] = 1;
		CHECK(ct_same(bbuf + 4096 * r, e.len, 80 + s));
	}
	CHECK_EQ(fi_cq_read(cqb, &e, 1), -FI_EAGAIN);
	for (int i = 0; i < 2; i++)
		CHECK_EQ(fi_close(&eb[i]->fid), 0);
	CHECK_EQ(fi_close(&srx->fid), 0);
	CHECK_EQ(fi_close(&other->fid), 0);
	CHECK_EQ(fi_close(&ea->fid), 0);
	CHECK_EQ(fi_close(&amr->fid), 0);
	CHECK_EQ(fi_close(&bmr->fid), 0);
	CHECK_EQ(fi_close(&cqa->fid), 0);
	CHECK_EQ(fi_close(&cqb->fid), 0);
	CHECK_EQ(fi_close(&ava->fid), 0);
	CHECK_EQ(fi_close(&avb->fid), 0);
	close_pair(list, fab, da, db);
}

/* A shared receive context of datagram endpoints. */
static void shared_rx_dgram(void)
{
	struct fi_info *h = ct_hints(FI_MSG, 1), *list = NULL, *rdm = NULL;
	h->ep_attr->type = FI_EP_DGRAM;
	h->ep_attr->rx_ctx_cnt = FI_SHARED_CONTEXT;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list) == 0);
	REQUIRE(list && list->next);
	h->ep_attr->type = FI_EP_RDM;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &rdm) == 0);
	fi_freeinfo(h);
	struct fid_fabric *fab = NULL;
	struct fid_domain *da = NULL, *db = NULL;
	open_pair(list, &fab, &da, &db);

	struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_TAGGED, .size = 64};
	struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
	struct fid_cq *cqa, *cqb;
	struct fid_av *ava, *avb;
	struct fid_ep *srx = NULL, *rc_srx = NULL, *ea, *eb[2], *r = NULL;
	REQUIRE(fi_av_open(da, &av_attr, &ava, NULL) == 0);
	REQUIRE(fi_av_open(db, &av_attr, &avb, NULL) == 0);
	REQUIRE(fi_cq_open(da, &cq_attr, &cqa, NULL) == 0);
	REQUIRE(fi_cq_open(db, &cq_attr, &cqb, NULL) == 0);
	REQUIRE(fi_srx_context(db, list->next->rx_attr, &srx, NULL) == 0);
	REQUIRE(fi_srx_context(db, NULL, &rc_srx, NULL) == 0);
	REQUIRE(fi_endpoint(da, list, &ea, NULL) == 0);
	REQUIRE(fi_ep_bind(ea, &ava->fid, 0) == 0);
	REQUIRE(fi_ep_bind(ea, &cqa->fid, FI_TRANSMIT | FI_RECV) == 0);
	REQUIRE(fi_enable(ea) == 0);

	char *abuf = ct_pages(1 << 16), *bbuf = ct_pages(1 << 16);
	struct fid_mr *amr, *bmr;
	REQUIRE(fi_mr_reg(da, abuf, 1 << 16, FI_SEND | FI_RECV, 0, 0, 0, &amr, NULL) == 0);
	REQUIRE(fi_mr_reg(db, bbuf, 1 << 16, FI_SEND | FI_RECV, 0, 0, 0, &bmr, NULL) == 0);
	/* A context that took a receive for RC connections takes no datagram endpoint. */
	CHECK_EQ(fi_recv(rc_srx, bbuf + 60000, 64, fi_mr_desc(bmr), FI_ADDR_UNSPEC, NULL), 0);

	fi_addr_t to_b[2];
	for (int i = 0; i < 2; i++) {
		REQUIRE(fi_endpoint(db, list->next, &eb[i], NULL) == 0);
		REQUIRE(fi_ep_bind(eb[i], &avb->fid, 0) == 0);
		REQUIRE(fi_ep_bind(eb[i], &cqb->fid, FI_TRANSMIT | FI_RECV) == 0);
		CHECK_EQ(fi_ep_bind(eb[i], &rc_srx->fid, 0), -FI_EINVAL);
		char before[64], name[64];
		size_t blen = sizeof(before), len = sizeof(name);
		REQUIRE(fi_getname(&eb[i]->fid, before, &blen) == 0);
		REQUIRE(fi_ep_bind(eb[i], &srx->fid, 0) == 0);
		REQUIRE(fi_enable(eb[i]) == 0);
		/* Its UD QP is new: so is its address. */
		REQUIRE(fi_getname(&eb[i]->fid, name, &len) == 0);
		CHECK(len == blen && memcmp(name, before, len) != 0);
		REQUIRE(fi_av_insert(ava, name, 1, &to_b[i], 0, NULL) == 1);
	}
	/* An RDM endpoint does not share a datagram context. */
	REQUIRE(fi_endpoint(db, rdm->next, &r, NULL) == 0);
	CHECK_EQ(fi_ep_bind(r, &srx->fid, 0), -FI_EINVAL);
	CHECK_EQ(fi_close(&r->fid), 0);

	/* Receives go to the context, not to its endpoints. */
	CHECK_EQ(fi_recv(eb[0], bbuf, 64, fi_mr_desc(bmr), FI_ADDR_UNSPEC, NULL), -FI_EOPBADSTATE);
	for (int k = 0; k < 8; k++)
		CHECK_EQ(fi_recv(srx, bbuf + 4096 * k, 4096, fi_mr_desc(bmr), FI_ADDR_UNSPEC,
				 (void *)(uintptr_t)(0xb0 + k)),
			 0);
	struct fi_cq_tagged_entry e;
	for (int k = 0; k < 8; k++) {
		ct_fill(abuf + 4096 * k, 500 + k, 30 + k);
		CHECK_EQ(fi_send(ea, abuf + 4096 * k, 500 + k, fi_mr_desc(amr), to_b[k % 2],
				 (void *)(uintptr_t)(0xa0 + k)),
			 0);
		CHECK(ct_wait(cqa, &e) && e.op_context == (void *)(uintptr_t)(0xa0 + k));
	}
	/* Every datagram, to either endpoint, in a receive of the context, each once. The
	 * context's receives are taken in the order posted and the datagrams arrive in the
	 * order sent (one sender: one path), so datagram k fills receive k. Datagrams to two
	 * endpoints are not ordered with each other (fi_msg(3) orders messages between one
	 * pair of endpoints): their completions may come in either order. */
	unsigned seen = 0;
	for (int n = 0; n < 8; n++) {
		fi_addr_t src = 0;
		if (ct_read(cqb, &e, &src, 30) != 1) {
			CHECK(!"a datagram in the shared context");
			break;
		}
		int k = (int)((uintptr_t)e.op_context - 0xb0);
		if (k < 0 || k >= 8 || (seen & (1u << k))) {
			CHECK(!"each receive of the context completes once");
			break;
		}
		seen |= 1u << k;
		CHECK_EQ(e.flags, FI_RECV | FI_MSG);
		CHECK_EQ(e.len, 500 + k);
		CHECK(e.buf == bbuf + 4096 * k);
		CHECK(ct_same(bbuf + 4096 * k, e.len, 30 + k));
		CHECK_EQ(src, FI_ADDR_NOTAVAIL);
	}
	CHECK_EQ(seen, 0xffu);
	CHECK(ct_quiet(cqb));
	for (int i = 0; i < 2; i++)
		CHECK_EQ(fi_close(&eb[i]->fid), 0);
	CHECK_EQ(fi_close(&srx->fid), 0);
	CHECK_EQ(fi_close(&rc_srx->fid), 0);
	CHECK_EQ(fi_close(&ea->fid), 0);
	CHECK_EQ(fi_close(&amr->fid), 0);
	CHECK_EQ(fi_close(&bmr->fid), 0);
	CHECK_EQ(fi_close(&cqa->fid), 0);
	CHECK_EQ(fi_close(&cqb->fid), 0);
	CHECK_EQ(fi_close(&ava->fid), 0);
	CHECK_EQ(fi_close(&avb->fid), 0);
	fi_freeinfo(rdm);
	close_pair(list, fab, da, db);
}

int main(void)
{
	ct_name = "shared_ctx";
	struct fi_info *h = ct_hints(FI_MSG, 1), *list = NULL, *none = NULL;
	h->ep_attr->tx_ctx_cnt = FI_SHARED_CONTEXT;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list) == 0);
	REQUIRE(list && list->next);
	CHECK_EQ(list->ep_attr->tx_ctx_cnt, FI_SHARED_CONTEXT);
	CHECK_EQ(list->ep_attr->rx_ctx_cnt, 1);
	h->ep_attr->rx_ctx_cnt = 2;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &none), -FI_ENODATA);
	fi_freeinfo(h);

	struct fid_fabric *fab = NULL;
	struct fid_domain *da = NULL, *db = NULL;
	open_pair(list, &fab, &da, &db);
	struct fid_stx *stx = NULL, *other = NULL;
	CHECK_EQ(fi_stx_context(da, list->tx_attr, NULL, NULL), -FI_EINVAL);
	struct fi_tx_attr big = *list->tx_attr;
	big.size = 1 << 30;
	CHECK_EQ(fi_stx_context(da, &big, &stx, NULL), -FI_EINVAL);
	REQUIRE(fi_stx_context(da, list->tx_attr, &stx, (void *)0x57) == 0);
	CHECK(stx->fid.fclass == FI_CLASS_STX_CTX && stx->fid.context == (void *)0x57);
	REQUIRE(fi_stx_context(db, NULL, &other, NULL) == 0);

	struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_TAGGED, .size = 64};
	struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
	struct fid_cq *cqa[2], *cqb;
	struct fid_av *ava, *avb;
	struct fid_ep *ea[2], *eb;
	REQUIRE(fi_av_open(da, &av_attr, &ava, NULL) == 0);
	REQUIRE(fi_av_open(db, &av_attr, &avb, NULL) == 0);
	REQUIRE(fi_cq_open(db, &cq_attr, &cqb, NULL) == 0);
	REQUIRE(fi_endpoint(db, list->next, &eb, NULL) == 0);
	REQUIRE(fi_ep_bind(eb, &avb->fid, 0) == 0);
	REQUIRE(fi_ep_bind(eb, &cqb->fid, FI_TRANSMIT | FI_RECV) == 0);
	REQUIRE(fi_ep_bind(eb, &other->fid, 0) == 0);
	REQUIRE(fi_enable(eb) == 0);
	char name[64];
	size_t len = sizeof(name);
	REQUIRE(fi_getname(&eb->fid, name, &len) == 0);
	fi_addr_t to_b;
	REQUIRE(fi_av_insert(ava, name, 1, &to_b, 0, NULL) == 1);
	for (int i = 0; i < 2; i++) {
		REQUIRE(fi_cq_open(da, &cq_attr, &cqa[i], NULL) == 0);
		REQUIRE(fi_endpoint(da, list, &ea[i], NULL) == 0);
		REQUIRE(fi_ep_bind(ea[i], &ava->fid, 0) == 0);
		REQUIRE(fi_ep_bind(ea[i], &cqa[i]->fid, FI_TRANSMIT | FI_RECV) == 0);
		/* A context of another domain is refused. */
		CHECK_EQ(fi_ep_bind(ea[i], &other->fid, 0), -FI_EINVAL);
		REQUIRE(fi_ep_bind(ea[i], &stx->fid, 0) == 0);
		REQUIRE(fi_enable(ea[i]) == 0);
	}
	/* Bound: the context stays until its endpoints close. */
	CHECK_EQ(fi_close(&stx->fid), -FI_EBUSY);

	char *abuf = ct_pages(1 << 16), *bbuf = ct_pages(1 << 16);
	struct fid_mr *amr, *bmr;
	REQUIRE(fi_mr_reg(da, abuf, 1 << 16, FI_SEND | FI_RECV, 0, 0, 0, &amr, NULL) == 0);
	REQUIRE(fi_mr_reg(db, bbuf, 1 << 16, FI_SEND | FI_RECV, 0, 0, 0, &bmr, NULL) == 0);
	for (int k = 0; k < 8; k++)
		CHECK_EQ(fi_recv(eb, bbuf + 4096 * k, 4096, fi_mr_desc(bmr), FI_ADDR_UNSPEC,
				 (void *)(uintptr_t)(0xb0 + k)),
			 0);
	/* Both endpoints send in turn through the shared context. */
	for (int k = 0; k < 8; k++) {
		ct_fill(abuf + 4096 * k, 1000 + k, 60 + k);
		CHECK_EQ(fi_send(ea[k % 2], abuf + 4096 * k, 1000 + k, fi_mr_desc(amr), to_b,
				 (void *)(uintptr_t)(0xa0 + k)),
			 0);
	}
	struct fi_cq_tagged_entry e;
	for (int k = 0; k < 8; k++) {
		/* Each endpoint's completions on its own CQ, in its order. */
		CHECK(ct_wait(cqa[k % 2], &e) && e.op_context == (void *)(uintptr_t)(0xa0 + k));
	}
	int seen[8] = {0};
	for (int k = 0; k < 8; k++) {
		if (!ct_wait(cqb, &e)) {
			CHECK(!"a receive");
			break;
		}
		int r = (int)((uintptr_t)e.op_context - 0xb0);
		REQUIRE(r >= 0 && r < 8);
		/* Which sender's message a receive took depends on the order of two
		 * connections; its length says which it is. */
		int s = (int)e.len - 1000;
		REQUIRE(s >= 0 && s < 8);
		CHECK(!seen[s]);
		seen[s] = 1;
		CHECK(ct_same(bbuf + 4096 * r, e.len, 60 + s));
	}
	for (int i = 0; i < 2; i++) {
		CHECK_EQ(fi_close(&ea[i]->fid), 0);
		CHECK_EQ(fi_close(&cqa[i]->fid), 0);
	}
	CHECK_EQ(fi_close(&stx->fid), 0);
	CHECK_EQ(fi_close(&eb->fid), 0);
	CHECK_EQ(fi_close(&other->fid), 0);
	CHECK_EQ(fi_close(&cqb->fid), 0);
	CHECK_EQ(fi_close(&amr->fid), 0);
	CHECK_EQ(fi_close(&bmr->fid), 0);
	CHECK_EQ(fi_close(&ava->fid), 0);
	CHECK_EQ(fi_close(&avb->fid), 0);
	close_pair(list, fab, da, db);
	shared_rx();
	shared_rx_dgram();
	return ct_summary_exit();
}
