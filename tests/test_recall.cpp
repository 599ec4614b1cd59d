// The shipped default model keeps its retrieval quality: recall over the held-out queries,
// measured through the real index-build and query pipelines (moe-eval-recall), stays at or above
// the figures docs/adaptation.md reports, minus a small margin.
#include <glib.h>
#include <gtest/gtest.h>
#include <json-glib/json-glib.h>

#include <string>

#include "moe_build_config.h"

namespace {

// docs/adaptation.md, "Engine measurement": base CLIP + MoE adapter on models/default/catalog.
constexpr double kDocumentedR10 = 0.975;
constexpr double kDocumentedMap = 0.672;
// The pipelines are deterministic; the margin only absorbs BLAS summation-order differences
// between machines.
constexpr double kMargin = 0.02;

double member(JsonObject* o, const char* key) { return json_object_get_double_member(o, key); }

}  // namespace

TEST(ShippedModel, RecallOverHeldOutQueriesThroughThePipelines) {
  const std::string root = std::string(MOE_SOURCE_DIR) + "/models/default/";
  const std::string model = root + "clip", adapter = root + "adapter", catalog = root + "catalog",
                    queries = root + "queries.jsonl";
  const gchar* argv[] = {MOE_EVAL_RECALL, "--model",   model.c_str(),   "--adapter", adapter.c_str(), "--catalog",
                         catalog.c_str(), "--queries", queries.c_str(), "--json",    nullptr};
  gchar** args = g_strdupv(const_cast<gchar**>(argv));
  gchar* out = nullptr;
  gchar* err = nullptr;
  gint status = -1;
  ASSERT_TRUE(g_spawn_sync(nullptr, args, nullptr, G_SPAWN_DEFAULT, nullptr, nullptr, &out, &err, &status, nullptr));
  g_strfreev(args);
  ASSERT_TRUE(g_spawn_check_wait_status(status, nullptr)) << out << err;
  JsonNode* doc = json_from_string(out, nullptr);
  ASSERT_NE(doc, nullptr) << out;
  JsonObject* o = json_node_get_object(doc);
  EXPECT_EQ(json_object_get_int_member(o, "queries"), 120);
  EXPECT_GE(member(o, "R@10"), kDocumentedR10 - kMargin) << out;
  EXPECT_GE(member(o, "mAP"), kDocumentedMap - kMargin) << out;
  std::printf("[ INFO     ] %s", out);
  json_node_unref(doc);
  g_free(out);
  g_free(err);
}
