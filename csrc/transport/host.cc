#include "transport/host.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "common/env.h"
#include "common/error.h"

namespace ddlcomm {
namespace {

std::string firstLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string namespaceId(const char* path) {
  struct stat st {};
  if (::stat(path, &st) != 0) return "?";
  return detail::concat(st.st_dev, ":", st.st_ino);
}

}  // namespace

std::string hostIdentity() {
  if (const char* name = envString("DDLCOMM_HOST_ID")) {
    const std::string id(name);
    bool printable = id.size() <= 255;
    for (unsigned char c : id) printable = printable && c > ' ' && c != 127;
    DDLCOMM_CHECK(printable, ErrorKind::InvalidArgument, "environment variable DDLCOMM_HOST_ID='", id,
                  "' is invalid: expected a name of 1 to 255 characters without spaces or control characters "
                  "(or unset: the machine and its network namespace)");
    return "name=" + id;
  }
  return detail::concat("boot=", machineIdentity(), " net=", namespaceId("/proc/self/ns/net"));
}

std::string machineIdentity() { return firstLine("/proc/sys/kernel/random/boot_id"); }

bool rdmaDevicePresent() {
  std::error_code ignored;
  std::filesystem::directory_iterator devices("/sys/class/infiniband", ignored);
  return !ignored && devices != std::filesystem::directory_iterator();
}

std::string kernelFacts() {
  return detail::concat("boot=", machineIdentity(), " userns=",
                        namespaceId("/proc/self/ns/user"), " pidns=", namespaceId("/proc/self/ns/pid"),
                        " uid=", ::geteuid());
}

}  // namespace ddlcomm
