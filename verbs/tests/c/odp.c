/* On-demand paging (IBV_ACCESS_ON_DEMAND) on the in-process NICs: the ODP caps of
 * ibv_query_device_ex; a region on demand is the process's memory as mapped when the NIC
 * uses it (nothing moved at registration, pages mapped afresh reached, an unmapped page
 * an error completion); ibv_advise_mr with the errnos of ibv_advise_mr(3); a QP whose
 * access flags carry IBV_ACCESS_ON_DEMAND (as rdma-core's tests pass them). */
#include "common.h"
#include <sys/mman.h>

static struct side a, b;

/* Whether the mapping that holds `p` is one of the library's memory files. */
static int moved(const void *p)
{
	FILE *f = fopen("/proc/self/maps", "r");
	CHECK(f != NULL);
	char line[512];
	int found = 0;
	while (fgets(line, sizeof(line), f)) {
		unsigned long s, e;
		if (sscanf(line, "%lx-%lx", &s, &e) == 2 && s <= (uintptr_t)p && (uintptr_t)p < e)
			found = strstr(line, "memfd:ringbell") != NULL;
	}
	fclose(f);
	return found;
}

static enum ibv_wc_status write_to(uint64_t raddr, uint32_t rkey, const char *what)
{
	size_t n = strlen(what);
	memcpy(a.buf, what, n);
	struct ibv_sge sge = {.addr = (uintptr_t)a.buf, .length = n, .lkey = a.mr->lkey};
	struct ibv_send_wr wr = {.wr_id = 1, .sg_list = &sge, .num_sge = 1,
				 .opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED};
	wr.wr.rdma.remote_addr = raddr;
	wr.wr.rdma.rkey = rkey;
	struct ibv_send_wr *bad = NULL;
	CHECK_RET(ibv_post_send(a.qp, &wr, &bad), 0);
	struct ibv_wc wc;
	POLL_ONE(a.cq, &wc);
	return wc.status;
}

int main(void)
{
	struct qp_opts o = default_qp_opts();
	pair_open(&a, &b, 0, 1 << 16, 64, &o);

	struct ibv_device_attr_ex ax;
	CHECK_RET(ibv_query_device_ex(b.ctx, NULL, &ax), 0);
	CHECK(ax.odp_caps.general_caps & IBV_ODP_SUPPORT);
	CHECK(ax.odp_caps.general_caps & IBV_ODP_SUPPORT_IMPLICIT);
	uint32_t rc = IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV | IBV_ODP_SUPPORT_WRITE |
		      IBV_ODP_SUPPORT_READ | IBV_ODP_SUPPORT_ATOMIC | IBV_ODP_SUPPORT_SRQ_RECV;
	CHECK_EQ(ax.odp_caps.per_transport_caps.rc_odp_caps & rc, rc);
	CHECK(ax.odp_caps.per_transport_caps.ud_odp_caps & IBV_ODP_SUPPORT_SEND);

	long page = sysconf(_SC_PAGESIZE);
	uint8_t *mem = mmap(NULL, 3 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
			    -1, 0);
	CHECK(mem != MAP_FAILED);
	struct ibv_mr *mr = ibv_reg_mr(b.pd, mem, 3 * page, ACC_ALL | IBV_ACCESS_ON_DEMAND);
	CHECK(mr != NULL);
	CHECK(!moved(mem));
	CHECK_EQ(write_to((uintptr_t)mem + 5, mr->rkey, "on demand"), IBV_WC_SUCCESS);
	CHECK(memcmp(mem + 5, "on demand", 9) == 0);
	/* Fresh pages under the region: reached by the next WRITE. */
	CHECK(mmap(mem + page, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
		   -1, 0) == mem + page);
	CHECK_EQ(write_to((uintptr_t)mem + page, mr->rkey, "fresh"), IBV_WC_SUCCESS);
	CHECK(memcmp(mem + page, "fresh", 5) == 0);

	/* ---- ibv_advise_mr ---- */
	struct ibv_sge sge = {.addr = (uintptr_t)mem, .length = 3 * page, .lkey = mr->lkey};
	CHECK_RET(ibv_advise_mr(b.pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &sge, 1), 0);
	CHECK_RET(ibv_advise_mr(b.pd, IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE,
				IBV_ADVISE_MR_FLAG_FLUSH, &sge, 1),
		  0);
	CHECK_RET(ibv_advise_mr(b.pd, IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT, 0, &sge, 1), 0);
	CHECK_RET(ibv_advise_mr(b.pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 2, &sge, 1), EINVAL);
	CHECK_RET(ibv_advise_mr(b.pd, 7, 0, &sge, 1), EOPNOTSUPP);
	CHECK_RET(ibv_advise_mr(b.pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &sge, 0), EINVAL);
	struct ibv_sge far = sge;
	far.length = 3 * page + 1;
	CHECK_RET(ibv_advise_mr(b.pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &far, 1), EFAULT);
	struct ibv_sge nokey = sge;
	nokey.lkey ^= 0x5500;
	CHECK_RET(ibv_advise_mr(b.pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &nokey, 1), EFAULT);
	/* Another PD's region is not this PD's. */
	CHECK_RET(ibv_advise_mr(a.pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &sge, 1), EFAULT);
	/* A pinned region is not on demand. */
	struct ibv_sge pinned = {.addr = (uintptr_t)b.buf, .length = 64, .lkey = b.mr->lkey};
	CHECK_RET(ibv_advise_mr(b.pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &pinned, 1), EINVAL);
	struct ibv_mr *ro = ibv_reg_mr(b.pd, mem, page, IBV_ACCESS_REMOTE_READ | IBV_ACCESS_ON_DEMAND);
	CHECK(ro != NULL);
	struct ibv_sge ros = {.addr = (uintptr_t)mem, .length = 64, .lkey = ro->lkey};
	CHECK_RET(ibv_advise_mr(b.pd, IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE, 0, &ros, 1), EPERM);
	CHECK_RET(ibv_dereg_mr(ro), 0);

	/* Re-registration of a region on demand is refused. */
	CHECK_EQ(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0, ACC_ALL),
		 IBV_REREG_MR_ERR_CMD);
	/* An implicit region covers the whole address space: any buffer through its key. */
	struct ibv_mr *all = ibv_reg_mr(b.pd, NULL, SIZE_MAX, ACC_ALL | IBV_ACCESS_ON_DEMAND);
	CHECK(all != NULL);
	CHECK(all->addr == NULL);
	CHECK_EQ(all->length, SIZE_MAX);
	static char somewhere[64];
	CHECK_EQ(write_to((uintptr_t)somewhere + 3, all->rkey, "implicit"), IBV_WC_SUCCESS);
	CHECK(memcmp(somewhere + 3, "implicit", 8) == 0);
	CHECK_RET(ibv_dereg_mr(all), 0);
	/* Without IBV_ACCESS_ON_DEMAND, NULL is no address. */
	CHECK_NULL_ERRNO(ibv_reg_mr(b.pd, NULL, SIZE_MAX, ACC_ALL), EINVAL);

	/* A page unmapped under the region fails the WRITE that needs it. */
	CHECK_EQ(munmap(mem + page, page), 0);
	CHECK(write_to((uintptr_t)mem + page, mr->rkey, "nowhere") != IBV_WC_SUCCESS);
	CHECK_RET(ibv_dereg_mr(mr), 0);
	CHECK_EQ(munmap(mem, page), 0);
	CHECK_EQ(munmap(mem + 2 * page, page), 0);

	/* A QP made with its regions' flags, IBV_ACCESS_ON_DEMAND among them. */
	struct ibv_qp *keep = b.qp;
	struct ibv_qp *qp = side_qp(&b, &o);
	struct ibv_qp_attr init = {.qp_state = IBV_QPS_INIT, .port_num = 1,
				   .qp_access_flags = ACC_ALL | IBV_ACCESS_ON_DEMAND};
	CHECK_RET(ibv_modify_qp(qp, &init,
				IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS),
		  0);
	CHECK_RET(ibv_destroy_qp(qp), 0);
	b.qp = keep;
	side_close(&a);
	side_close(&b);
	printf("on-demand paging: every check passed\n");
	return 0;
}
