/* Devices: the device list, names, GUIDs, opening and closing, and every query verb on a
 * ringbell context (device, extended device, port, GID, GID table, P_Key), with bad
 * ports and indices; the device nodes that libraries such as UCX look for. */
#include "common.h"
#include <sys/stat.h>
#include <sys/sysmacros.h>

/* /dev/infiniband/<dev_name>, as UCX checks it before using a device: a character device it
 * may read and write, whether the node exists or the library answers for it. A name that is
 * no ringbell NIC's keeps the system's answer. */
static void check_device_node(struct ibv_device *dev)
{
	char path[256];
	snprintf(path, sizeof(path), "/dev/infiniband/%s", dev->dev_name);
	struct stat st;
	if (stat(path, &st) != 0)
		FAIL("stat(%s): %s", path, strerror(errno));
	CHECK(S_ISCHR(st.st_mode));
	CHECK_EQ(access(path, R_OK | W_OK), 0);
	CHECK_EQ(access(path, F_OK), 0);
	struct stat none;
	if (stat("/dev/infiniband/uverbs-rb999", &none) == 0)
		FAIL("a node of no ringbell NIC exists");
	CHECK_EQ(errno, ENOENT);
	CHECK_EQ(access("/dev/infiniband/uverbs-rb999", F_OK), -1);
	CHECK_EQ(errno, ENOENT);
	/* Other paths are the system's. */
	CHECK_EQ(stat("/", &none), 0);
	CHECK(S_ISDIR(none.st_mode));
	printf("  %s: a character device (%u:%u), readable and writable\n", path,
	       major(st.st_rdev), minor(st.st_rdev));
}

static void check_gid(const union ibv_gid *g, uint8_t last)
{
	static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
	CHECK_MEM(g->raw, prefix, 12);
	CHECK_EQ(g->raw[12], 10);
	CHECK_EQ(g->raw[13], 0);
	CHECK_EQ(g->raw[14], 0);
	CHECK_EQ(g->raw[15], last);
}

static void query_everything(struct ibv_device *dev, uint8_t gid_last)
{
	struct ibv_context *ctx = ibv_open_device(dev);
	CHECK(ctx != NULL);
	CHECK(ctx->device == dev);
	CHECK(ctx->async_fd >= 0);
	CHECK(ctx->num_comp_vectors >= 1);

	struct ibv_device_attr da;
	memset(&da, 0xa5, sizeof(da));
	CHECK_RET(ibv_query_device(ctx, &da), 0);
	CHECK(da.max_qp > 0);
	CHECK(da.max_qp_wr > 0);
	CHECK(da.max_cq > 0);
	CHECK(da.max_cqe > 0);
	CHECK(da.max_mr > 0);
	/* A region may span the process's address space (implicit ODP regions do). */
	CHECK_EQ(da.max_mr_size, 1ull << 47);
	CHECK(da.max_pd > 0);
	CHECK(da.max_sge > 0);
	CHECK(da.max_srq > 0);
	CHECK(da.atomic_cap == IBV_ATOMIC_HCA || da.atomic_cap == IBV_ATOMIC_GLOB);
	CHECK_EQ(da.phys_port_cnt, 1);
	CHECK(da.fw_ver[0] != 0);
	CHECK(memchr(da.fw_ver, 0, sizeof(da.fw_ver)) != NULL);
	CHECK(da.node_guid != 0);
	/* The GUID the device list shows is the node GUID the device reports. */
	CHECK_EQ(da.node_guid, ibv_get_device_guid(dev));
	CHECK_RET(ibv_query_device(ctx, NULL), EINVAL);

	struct ibv_device_attr_ex dx;
	memset(&dx, 0xa5, sizeof(dx));
	CHECK_RET(ibv_query_device_ex(ctx, NULL, &dx), 0);
	CHECK_EQ(dx.orig_attr.max_qp, da.max_qp);
	CHECK_EQ(dx.orig_attr.node_guid, da.node_guid);
	CHECK(dx.tm_caps.max_num_tags > 0);
	CHECK(dx.tm_caps.flags & IBV_TM_CAP_RC);
	CHECK(dx.tm_caps.max_ops > 0);
	CHECK(dx.tm_caps.max_sge >= 1);
	CHECK(dx.tm_caps.max_rndv_hdr_size >= 32);
	struct ibv_query_device_ex_input in = {.comp_mask = 0};
	CHECK_RET(ibv_query_device_ex(ctx, &in, &dx), 0);
	in.comp_mask = 1u << 31;
	CHECK_RET(ibv_query_device_ex(ctx, &in, &dx), EINVAL);

	struct ibv_port_attr pa;
	memset(&pa, 0xa5, sizeof(pa));
	CHECK_RET(ibv_query_port(ctx, 1, &pa), 0);
	CHECK_EQ(pa.state, IBV_PORT_ACTIVE);
	CHECK_EQ(pa.link_layer, IBV_LINK_LAYER_ETHERNET);
	CHECK(pa.gid_tbl_len >= 2);
	CHECK(pa.max_msg_sz > 0);
	CHECK(pa.active_mtu >= IBV_MTU_1024);
	CHECK_RET(ibv_query_port(ctx, 2, &pa), EINVAL);
	CHECK_RET(ibv_query_port(ctx, 0, &pa), EINVAL);

	/* GID 0 is the RoCEv2 GID of the NIC's address; entry 1 is empty. */
	union ibv_gid g;
	CHECK_OK(ibv_query_gid(ctx, 1, 0, &g));
	check_gid(&g, gid_last);
	memset(&g, 0xa5, sizeof(g));
	CHECK_OK(ibv_query_gid(ctx, 1, 1, &g));
	static const uint8_t zero[16];
	CHECK_MEM(g.raw, zero, 16);
	errno = 0;
	CHECK_EQ(ibv_query_gid(ctx, 1, pa.gid_tbl_len, &g), -1);
	errno = 0;
	CHECK_EQ(ibv_query_gid(ctx, 2, 0, &g), -1);

	struct ibv_gid_entry ge;
	memset(&ge, 0xa5, sizeof(ge));
	CHECK_RET(ibv_query_gid_ex(ctx, 1, 0, &ge, 0), 0);
	check_gid(&ge.gid, gid_last);
	CHECK_EQ(ge.gid_index, 0);
	CHECK_EQ(ge.port_num, 1);
	CHECK_EQ(ge.gid_type, IBV_GID_TYPE_ROCE_V2);
	CHECK_RET(ibv_query_gid_ex(ctx, 1, 1, &ge, 0), ENODATA);
	CHECK_RET(ibv_query_gid_ex(ctx, 2, 0, &ge, 0), EINVAL);
	CHECK_RET(ibv_query_gid_ex(ctx, 1, 0, &ge, 1), EINVAL);

	struct ibv_gid_entry table[8];
	memset(table, 0xa5, sizeof(table));
	ssize_t n = ibv_query_gid_table(ctx, table, 8, 0);
	CHECK_EQ(n, 1);
	check_gid(&table[0].gid, gid_last);
	CHECK_EQ(table[0].gid_index, 0);
	CHECK_EQ(table[0].port_num, 1);
	CHECK_EQ(table[0].gid_type, IBV_GID_TYPE_ROCE_V2);
	CHECK_EQ(ibv_query_gid_table(ctx, table, 8, 1), -EINVAL);

	__be16 pkey = 0;
	CHECK_OK(ibv_query_pkey(ctx, 1, 0, &pkey));
	CHECK_EQ(pkey, 0xffff);
	CHECK_EQ(ibv_query_pkey(ctx, 1, 1, &pkey), -1);
	CHECK_EQ(ibv_get_pkey_index(ctx, 1, 0xffff), 0);

	CHECK_RET(ibv_close_device(ctx), 0);
	/* A closed context is refused, not used. */
	CHECK_RET(ibv_close_device(ctx), EINVAL);
}

/* Verbs a ringbell device does not have: each refuses cleanly (EOPNOTSUPP), through the
 * extended context's empty slots or the library's own answer, and the verbs it has beyond
 * the basics answer. */
static void other_verbs(void)
{
	struct ibv_context *ctx = open_dev("rb0");
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	CHECK(pd != NULL);
	struct ibv_cq *cq = ibv_create_cq(ctx, 8, NULL, NULL, 0);
	CHECK(cq != NULL);
	struct ibv_qp_init_attr ia = {
		.send_cq = cq,
		.recv_cq = cq,
		.cap = {.max_send_wr = 2, .max_recv_wr = 2, .max_send_sge = 1, .max_recv_sge = 1},
		.qp_type = IBV_QPT_RC,
	};
	struct ibv_qp *qp = ibv_create_qp(pd, &ia);
	CHECK(qp != NULL);

	/* Memory windows are supported (mw.c), and XRC domains (xrc.c). */
	struct ibv_xrcd_init_attr xa = {.comp_mask = IBV_XRCD_INIT_ATTR_FD |
						     IBV_XRCD_INIT_ATTR_OFLAGS,
					.fd = -1,
					.oflags = O_CREAT};
	struct ibv_xrcd *xrcd = ibv_open_xrcd(ctx, &xa);
	CHECK(xrcd != NULL);
	CHECK_RET(ibv_close_xrcd(xrcd), 0);
	/* Device memory is supported (dm.c). */
	/* Thread domains are supported (parent_domain.c). */
	struct ibv_td_init_attr ta = {0};
	struct ibv_td *td = ibv_alloc_td(ctx, &ta);
	CHECK(td != NULL);
	CHECK_RET(ibv_dealloc_td(td), 0);
	struct ibv_counters_init_attr ca = {0};
	CHECK_NULL_ERRNO(ibv_create_counters(ctx, &ca), EOPNOTSUPP);
	struct ibv_wq_init_attr wa = {.wq_type = IBV_WQT_RQ, .max_wr = 1, .max_sge = 1,
				      .pd = pd, .cq = cq};
	/* Receive WQs, rules and RSS are supported (raw.c); a rule steers to a raw packet QP
	 * only, as Linux's (EINVAL for this RC QP). */
	struct ibv_wq *wq = ibv_create_wq(ctx, &wa);
	CHECK(wq != NULL && wq->state == IBV_WQS_RESET);
	CHECK_RET(ibv_destroy_wq(wq), 0);
	struct ibv_flow_attr fa = {.size = sizeof(fa), .port = 1};
	CHECK_NULL_ERRNO(ibv_create_flow(qp, &fa), EINVAL);
	struct ibv_ah_attr aa = {.is_global = 1, .port_num = 1};
	aa.grh.dgid = gid_of(ctx);
	struct ibv_ah *ah = ibv_create_ah(pd, &aa);
	CHECK(ah != NULL);
	CHECK_RET(ibv_destroy_ah(ah), 0);
	CHECK_NULL_ERRNO(ibv_reg_dmabuf_mr(pd, 0, 4096, 0, 0, IBV_ACCESS_LOCAL_WRITE),
			 EOPNOTSUPP);
	/* Another handle on the PD in its own context (import.c has the rest). */
	struct ibv_pd *again = ibv_import_pd(ctx, pd->handle);
	CHECK(again != NULL && again != pd && again->handle == pd->handle);
	ibv_unimport_pd(again);
	struct ibv_ece ece;
	CHECK_RET(ibv_query_ece(qp, &ece), EOPNOTSUPP);
	union ibv_gid mgid = {.raw = {0xff, 0x12}};
	CHECK_RET(ibv_attach_mcast(qp, &mgid, 0), EOPNOTSUPP);
	/* A size below 1 is invalid (resizing itself is cq.c's). */
	int cqe = cq->cqe;
	CHECK(cqe >= 8);
	CHECK_RET(ibv_resize_cq(cq, 0), EINVAL);
	CHECK_EQ(cq->cqe, cqe);
	/* The device clock. */
	struct ibv_values_ex v = {.comp_mask = IBV_VALUES_MASK_RAW_CLOCK};
	CHECK_RET(ibv_query_rt_values_ex(ctx, &v), 0);
	CHECK(v.raw_clock.tv_sec >= 0 && v.raw_clock.tv_nsec >= 0 &&
	      v.raw_clock.tv_nsec < 1000000000);
	/* The exported (pre-extended) ibv_query_port, as old binaries call it. */
	struct ibv_port_attr pa;
	memset(&pa, 0, sizeof(pa));
	CHECK_EQ((ibv_query_port)(ctx, 1, (struct _compat_ibv_port_attr *)&pa), 0);
	CHECK_EQ(pa.state, IBV_PORT_ACTIVE);
	CHECK_EQ(pa.link_layer, IBV_LINK_LAYER_ETHERNET);
	CHECK(ibv_get_device_index(ctx->device) >= 0);

	CHECK_RET(ibv_destroy_qp(qp), 0);
	CHECK_RET(ibv_destroy_cq(cq), 0);
	CHECK_RET(ibv_dealloc_pd(pd), 0);
	CHECK_RET(ibv_close_device(ctx), 0);
	printf("  unsupported verbs refuse with EOPNOTSUPP; clock, compat query\n");
}

int main(void)
{
	int n = -1;
	struct ibv_device **list = ibv_get_device_list(&n);
	CHECK(list != NULL);
	CHECK(n >= 2);
	/* NULL-terminated, with exactly n devices before the NULL. */
	CHECK(list[n] == NULL);
	int rb0 = -1, rb1 = -1;
	for (int i = 0; i < n; i++) {
		CHECK(list[i] != NULL);
		const char *name = ibv_get_device_name(list[i]);
		CHECK(name != NULL);
		if (strcmp(name, "rb0") == 0)
			rb0 = i;
		if (strcmp(name, "rb1") == 0)
			rb1 = i;
	}
	if (rb0 < 0 || rb1 < 0)
		FAIL("rb0 and rb1 are not both listed (%d devices)", n);
	uint64_t g0 = ibv_get_device_guid(list[rb0]), g1 = ibv_get_device_guid(list[rb1]);
	CHECK(g0 != 0);
	CHECK(g1 != 0);
	CHECK(g0 != g1);
	CHECK(ibv_get_device_index(list[rb0]) >= 0);
	CHECK(ibv_get_device_index(list[rb0]) != ibv_get_device_index(list[rb1]));
	CHECK(list[rb0]->transport_type == IBV_TRANSPORT_IB);
	check_device_node(list[rb0]);
	check_device_node(list[rb1]);

	/* A second list names the same devices (device pointers live as long as the process). */
	int n2 = 0;
	struct ibv_device **list2 = ibv_get_device_list(&n2);
	CHECK(list2 != NULL);
	CHECK_EQ(n2, n);
	CHECK(list2[rb0] == list[rb0]);
	CHECK(list2[n2] == NULL);
	ibv_free_device_list(list2);
	/* The count pointer is optional. */
	list2 = ibv_get_device_list(NULL);
	CHECK(list2 != NULL);
	ibv_free_device_list(list2);

	query_everything(list[rb0], 1);
	query_everything(list[rb1], 2);

	/* Two contexts on one device at once. */
	struct ibv_context *c1 = ibv_open_device(list[rb0]);
	struct ibv_context *c2 = ibv_open_device(list[rb0]);
	CHECK(c1 != NULL && c2 != NULL && c1 != c2);
	CHECK_RET(ibv_close_device(c1), 0);
	CHECK_RET(ibv_close_device(c2), 0);

	/* NULL arguments are refused, not dereferenced. */
	CHECK_NULL_ERRNO(ibv_open_device(NULL), EINVAL);
	CHECK_RET(ibv_close_device(NULL), EINVAL);

	other_verbs();

	ibv_free_device_list(list);
	ibv_free_device_list(NULL);
	printf("devices: ok\n");
	return 0;
}
