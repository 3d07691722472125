#include "kernel_cache.hpp"

#include <chrono>
#include <map>
#include <mutex>
#include <utility>

#include "kernel_sources.hpp"

namespace graphattn {
namespace sycl_plugin {

namespace syclex = sycl::ext::oneapi::experimental;
using ExecutableBundle = sycl::kernel_bundle<sycl::bundle_state::executable>;

namespace {

struct Cache {
    std::mutex lock;
    std::map<std::pair<std::string, size_t>, ExecutableBundle> bundles;  // (variant key, context hash)
    std::map<std::pair<std::string, size_t>, std::string> failures;      // builds that failed, with the error
    int64_t builds = 0;
    double seconds = 0.0;
};

// Held on the heap and never freed: destroying SYCL objects after the
// runtime has shut down (at interpreter exit) crashes.
Cache& cache() {
    static Cache* instance = new Cache();
    return *instance;
}

std::string variant_key(const sycl::device& device, const KernelVariant& v) {
    std::string key = device.get_info<sycl::info::device::name>() + "|" + v.source;
    for (const std::string& option : v.options) key += "|" + option;
    return key;
}

syclex::include_files embedded_headers() {
    syclex::include_files headers;
    for (const SourceFile* f = kKernelSources; f->name != nullptr; ++f) {
        const std::string name = f->name;
        if (name.size() > 4 && name.compare(name.size() - 4, 4, ".hpp") == 0) headers.add(name, f->text);
    }
    return headers;
}

}  // namespace

ExecutableBundle& kernel_bundle_for(sycl::queue& queue, const KernelVariant& variant) {
    Cache& c = cache();
    const auto key = std::make_pair(variant_key(queue.get_device(), variant), std::hash<sycl::context>()(queue.get_context()));
    std::lock_guard<std::mutex> guard(c.lock);
    auto found = c.bundles.find(key);
    if (found != c.bundles.end()) return found->second;
    auto failed = c.failures.find(key);  // a failed build is not retried: it would fail again, slowly
    if (failed != c.failures.end()) throw sycl::exception(sycl::errc::build, failed->second);
    const char* text = kernel_source(variant.source.c_str());
    if (text == nullptr) throw sycl::exception(sycl::errc::invalid, "no embedded kernel source " + variant.source);
    const auto start = std::chrono::steady_clock::now();
    auto source = syclex::create_kernel_bundle_from_source(queue.get_context(), syclex::source_language::sycl, text,
                                                           syclex::properties{embedded_headers()});
    std::vector<std::string> options = variant.options;
    options.push_back("-DSYCL_DISABLE_FSYCL_SYCLHPP_WARNING");
    std::string log;
    try {
        ExecutableBundle built = syclex::build(source, std::vector<sycl::device>{queue.get_device()},
                                               syclex::properties{syclex::build_options{options}, syclex::save_log{&log}});
        c.builds += 1;
        c.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        return c.bundles.emplace(key, std::move(built)).first->second;
    } catch (const sycl::exception& e) {
        c.failures.emplace(key, e.what());
        throw;
    }
}

bool bundle_has_kernel(ExecutableBundle& bundle, const char* name) { return bundle.ext_oneapi_has_kernel(name); }

int64_t build_count() {
    std::lock_guard<std::mutex> guard(cache().lock);
    return cache().builds;
}

double build_seconds() {
    std::lock_guard<std::mutex> guard(cache().lock);
    return cache().seconds;
}

}  // namespace sycl_plugin
}  // namespace graphattn
