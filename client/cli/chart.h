// A small SVG line-chart writer for attn bench: panels side by side, log-log axes, legends.
// No libraries; the output is a standalone SVG 1.1 document.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace attn::cli {

enum class LineStyle { kSolid, kDashed, kDotted };

// What an axis measures, which picks its ticks and labels (all axes are logarithmic):
//   kCount    powers of 2, labelled as integers (256, 512, …),
//   kSeconds  decades, with 2 and 5 between them when the range is narrow (1 ms, 2 ms, 5 ms, …),
//   kBytes    powers of 2, labelled in B, KiB, MiB, GiB, TiB.
enum class AxisUnit { kCount, kSeconds, kBytes };

struct Series {
  std::string label;
  std::string color;  // Any SVG colour, e.g. "#1f77b4".
  LineStyle style = LineStyle::kSolid;
  bool markers = true;  // A dot at each point.
  // (x, y) in increasing x. A point whose x or y is not positive and finite is not drawn and
  // breaks the line there.
  std::vector<std::pair<double, double>> points;
};

// A labelled horizontal reference line across the plot, e.g. a server limit.
struct Rule {
  double y = 0;
  std::string label;
};

struct Panel {
  std::string title;
  std::string x_title, y_title;
  AxisUnit x_unit = AxisUnit::kCount;
  AxisUnit y_unit = AxisUnit::kSeconds;
  std::vector<Series> series;
  std::vector<Rule> rules;
  std::vector<std::string> notes;  // Small lines of text under the legend.
};

struct Chart {
  std::string title;
  std::string subtitle;
  std::vector<Panel> panels;  // Drawn left to right.
};

// The chart as an SVG document.
std::string RenderSvg(const Chart& chart);

}  // namespace attn::cli
