"""Engine plugin entry points of torch_sdcp, outside the torch_sdcp package so
that an engine loading them imports nothing of torch_sdcp (and loads no C++
extension) while the plugin is off. Each module reads its one setting and only
then imports its face in torch_sdcp.integrations."""
