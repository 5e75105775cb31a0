#include "router/api_keys.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::router {
namespace {

using ::testing::HasSubstr;

TEST(ApiKeysTest, ParsesKeysAndFindsTheirTenants) {
  absl::StatusOr<ApiKeys> keys = ApiKeys::Parse(
      "# key tenant\n"
      "sk-team-a-0123456789abcdef team-a\n"
      "\n"
      "  sk-team-b-0123456789abcdef   team-b  \n",
      "keys.txt");
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_EQ(keys->size(), 2u);
  EXPECT_EQ(keys->TenantOf("sk-team-a-0123456789abcdef"), "team-a");
  EXPECT_EQ(keys->TenantOf("sk-team-b-0123456789abcdef"), "team-b");
  EXPECT_EQ(keys->TenantOf("sk-team-a-0123456789abcdeF"), std::nullopt);
  EXPECT_EQ(keys->TenantOf(""), std::nullopt);
}

TEST(ApiKeysTest, BadFilesAreRefusedNamingTheLine) {
  auto error = [](const char* text) {
    absl::StatusOr<ApiKeys> k = ApiKeys::Parse(text, "keys.txt");
    return k.ok() ? std::string("ok") : std::string(k.status().message());
  };
  EXPECT_THAT(error("short team-a\n"), HasSubstr("keys.txt:1: a key is 16 to 256"));
  EXPECT_THAT(error("sk-0123456789abcdef\n"), HasSubstr("keys.txt:1: expected 'KEY TENANT'"));
  EXPECT_THAT(error("# c\nsk-0123456789abcdef team/a\n"), HasSubstr("keys.txt:2: a tenant is"));
  EXPECT_THAT(error("sk-0123456789abcdef a\nsk-0123456789abcdef b\n"),
              HasSubstr("keys.txt:2: this key is listed twice"));
  EXPECT_THAT(error("# nothing\n"), HasSubstr("lists no key"));
  EXPECT_EQ(ApiKeys::Load("/nonexistent/keys").status().code(), absl::StatusCode::kNotFound);
}

TEST(ApiKeysTest, BearerHeadersAndTenantSalts) {
  EXPECT_EQ(BearerKey("Bearer sk-abc"), "sk-abc");
  EXPECT_EQ(BearerKey("bearer   sk-abc  "), "sk-abc");
  EXPECT_EQ(BearerKey("Basic dXNlcjpwYXNz"), "");
  EXPECT_EQ(BearerKey(""), "");
  // Tenants never share a salt, whatever salt their clients send.
  EXPECT_NE(TenantSalt("team-a", ""), TenantSalt("team-b", ""));
  EXPECT_NE(TenantSalt("team-a", "x"), TenantSalt("team-b", "x"));
  EXPECT_NE(TenantSalt("team-a", ""), TenantSalt("team-a", "x"));
}

}  // namespace
}  // namespace strata::router
