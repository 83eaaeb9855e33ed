/* shared_tx.c: shared transmit contexts (fi_stx_context, fi_endpoint(3)): the offer for
 * hints asking tx_ctx_cnt = FI_SHARED_CONTEXT (and none for a shared receive context), the
 * context's refusals, and two endpoints of rb0 bound to one context sending to rb1, each
 * with its own completions, in order.
 */
#include "ctest.h"

int main(void)
{
	ct_name = "shared_tx";
	struct fi_info *h = ct_hints(FI_MSG, 1), *list = NULL, *none = NULL;
	h->ep_attr->tx_ctx_cnt = FI_SHARED_CONTEXT;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list) == 0);
	REQUIRE(list && list->next);
	CHECK_EQ(list->ep_attr->tx_ctx_cnt, FI_SHARED_CONTEXT);
	CHECK_EQ(list->ep_attr->rx_ctx_cnt, 1);
	h->ep_attr->rx_ctx_cnt = FI_SHARED_CONTEXT;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &none), -FI_ENODATA);
	fi_freeinfo(h);

	struct fid_fabric *fab = NULL;
	struct fid_domain *da = NULL, *db = NULL;
	REQUIRE(fi_fabric(list->fabric_attr, &fab, NULL) == 0);
	REQUIRE(fi_domain(fab, list, &da, NULL) == 0);
	REQUIRE(fi_domain(fab, list->next, &db, NULL) == 0);
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
	CHECK_EQ(fi_close(&da->fid), 0);
	CHECK_EQ(fi_close(&db->fid), 0);
	CHECK_EQ(fi_close(&fab->fid), 0);
	fi_freeinfo(list);
	return ct_summary_exit();
}
