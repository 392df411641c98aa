// The store of a job on one node: see local_store.h.
#include "launch/local_store.h"

#include <chrono>
#include <exception>

#include "fsdp/compat_backends.h"
#include "launch/options.h"

namespace fsdp_run {

std::shared_ptr<void> host_local_store(Options& o, std::string& error) {
  try {
    auto store =
        fsdp::compat::make_tcp_store(o.store_host, static_cast<std::uint16_t>(o.store_port),
                                     /*is_server=*/true, -1, std::chrono::seconds(30));
    o.store_port = store->getPort();
    // The intrusive pointer held by a shared_ptr whose deleter keeps it: the caller only holds.
    auto* keep = new c10::intrusive_ptr<c10d::TCPStore>(std::move(store));
    return std::shared_ptr<void>(
        keep, [](void* p) { delete static_cast<c10::intrusive_ptr<c10d::TCPStore>*>(p); });
  } catch (const std::exception& e) {
    error = "could not host the ranks' store on " + o.store_host + ":" +
            std::to_string(o.store_port) + ": " + e.what() +
            (o.port_chosen ? " (is --master-port in use?)" : "");
    return nullptr;
  }
}

}  // namespace fsdp_run
