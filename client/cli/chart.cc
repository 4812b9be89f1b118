#include "client/cli/chart.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace attn::cli {
namespace {

// Geometry, in SVG user units (pixels).
constexpr double kPanelWidth = 580;
constexpr double kPanelGap = 20;
constexpr double kMarginX = 20;       // Left and right of the whole chart.
constexpr double kHeaderHeight = 64;  // Title and subtitle.
constexpr double kPlotLeft = 78;      // Panel edge to plot area: y tick labels and y title.
constexpr double kPlotRight = 16;
constexpr double kPlotTop = 30;  // Panel edge to plot area: the panel's title.
constexpr double kPlotHeight = 360;
constexpr double kAxisHeight = 52;  // Below the plot: x tick labels and x title.
constexpr double kLegendRow = 20;
constexpr double kNoteRow = 17;
constexpr const char* kFont = "DejaVu Sans, Helvetica, Arial, sans-serif";

struct Tick {
  double value;
  std::string label;
};

bool Drawable(double x, double y) { return std::isfinite(x) && std::isfinite(y) && x > 0 && y > 0; }

std::string Escape(const std::string& text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string PowerOfTwoBytes(int exponent) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (exponent < 0) return absl::StrFormat("%g B", std::ldexp(1.0, exponent));
  const int unit = std::min(exponent / 10, 6);
  return absl::StrFormat("%.0f %s", std::ldexp(1.0, exponent - 10 * unit), kUnits[unit]);
}

std::string Seconds(double value) {
  struct Unit {
    double scale;
    const char* name;
  };
  static const Unit kUnits[] = {{1, "s"}, {1e-3, "ms"}, {1e-6, "µs"}, {1e-9, "ns"}};
  for (const Unit& unit : kUnits) {
    // A little below the unit still reads better in it than as 1000 of the next (0.999 ms).
    if (value >= unit.scale * 0.9995 || unit.scale == 1e-9) {
      return absl::StrFormat("%.3g %s", value / unit.scale, unit.name);
    }
  }
  return absl::StrFormat("%g s", value);
}

// Ticks for a log axis over [lo, hi]; widens the range until it holds at least two ticks.
std::vector<Tick> Ticks(AxisUnit unit, double& lo, double& hi) {
  for (;;) {
    std::vector<Tick> ticks;
    if (unit == AxisUnit::kSeconds) {
      const double decades = std::log10(hi / lo);
      const int first = static_cast<int>(std::floor(std::log10(lo)));
      const int last = static_cast<int>(std::ceil(std::log10(hi)));
      const int decade_step = decades > 8 ? 2 : 1;
      for (int e = first; e <= last; ++e) {
        if (e % decade_step != 0) continue;
        for (const double m : {1.0, 2.0, 5.0}) {
          if (m != 1.0 && decades > 3) continue;
          const double value = m * std::pow(10.0, e);
          if (value >= lo * (1 - 1e-9) && value <= hi * (1 + 1e-9)) {
            ticks.push_back({value, Seconds(value)});
          }
        }
      }
    } else {
      const int first = static_cast<int>(std::ceil(std::log2(lo) - 1e-9));
      const int last = static_cast<int>(std::floor(std::log2(hi) + 1e-9));
      // Steps that keep power-of-two byte labels on round units (1 KiB, 32 KiB, 1 MiB, …).
      int step = 1;
      for (const int candidate : {1, 2, 5, 10, 20}) {
        step = candidate;
        const int count = last / candidate - (first + candidate - 1) / candidate + 1;
        if (count <= 8) break;
      }
      for (int e = first; e <= last; ++e) {
        if (((e % step) + step) % step != 0) continue;
        const double value = std::ldexp(1.0, e);
        ticks.push_back({value, unit == AxisUnit::kBytes ? PowerOfTwoBytes(e)
                                                         : absl::StrFormat("%.0f", value)});
      }
    }
    if (ticks.size() >= 2) return ticks;
    lo /= 1.5;
    hi *= 1.5;
  }
}

// Maps a value to a coordinate on a log axis from `from` (at lo) to `to` (at hi).
struct LogScale {
  double lo, hi, from, to;
  double operator()(double v) const {
    return from + (std::log(v) - std::log(lo)) / (std::log(hi) - std::log(lo)) * (to - from);
  }
};

const char* DashArray(LineStyle style) {
  switch (style) {
    case LineStyle::kSolid:
      return "";
    case LineStyle::kDashed:
      return " stroke-dasharray=\"8 5\"";
    case LineStyle::kDotted:
      return " stroke-dasharray=\"0.5 4.5\" stroke-linecap=\"round\"";
  }
  return "";
}

double StrokeWidth(LineStyle style) { return style == LineStyle::kSolid ? 2.2 : 2.0; }

std::string Marker(const Series& series, double x, double y) {
  // Filled dots on solid lines, hollow ones on dashed and dotted lines.
  const bool filled = series.style == LineStyle::kSolid;
  return absl::StrFormat(
      "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\" fill=\"%s\" stroke=\"%s\" "
      "stroke-width=\"1.5\"/>\n",
      x, y, filled ? series.color : "white", series.color);
}

int LegendRows(const Panel& panel) { return (static_cast<int>(panel.series.size()) + 1) / 2; }

void RenderPanel(std::string& svg, const Panel& panel, int index, double left, double top) {
  const double plot_left = left + kPlotLeft;
  const double plot_right = left + kPanelWidth - kPlotRight;
  const double plot_top = top + kPlotTop;
  const double plot_bottom = plot_top + kPlotHeight;

  // Data ranges, padded so that no point sits on the frame.
  double x_lo = std::numeric_limits<double>::infinity(), x_hi = 0;
  double y_lo = std::numeric_limits<double>::infinity(), y_hi = 0;
  for (const Series& series : panel.series) {
    for (const auto& [x, y] : series.points) {
      if (!Drawable(x, y)) continue;
      x_lo = std::min(x_lo, x);
      x_hi = std::max(x_hi, x);
      y_lo = std::min(y_lo, y);
      y_hi = std::max(y_hi, y);
    }
  }
  for (const Rule& rule : panel.rules) {
    if (rule.y > 0 && std::isfinite(rule.y)) {
      y_lo = std::min(y_lo, rule.y);
      y_hi = std::max(y_hi, rule.y);
    }
  }
  if (x_hi == 0) x_lo = x_hi = 1;  // Nothing to draw: an empty frame with some axes.
  if (y_hi == 0) y_lo = y_hi = 1;
  x_lo /= std::pow(2.0, 0.3);
  x_hi *= std::pow(2.0, 0.3);
  y_lo /= 1.6;
  y_hi *= 1.6;
  const std::vector<Tick> x_ticks = Ticks(panel.x_unit, x_lo, x_hi);
  const std::vector<Tick> y_ticks = Ticks(panel.y_unit, y_lo, y_hi);
  const LogScale sx{x_lo, x_hi, plot_left, plot_right};
  const LogScale sy{y_lo, y_hi, plot_bottom, plot_top};

  absl::StrAppendFormat(&svg, "<g id=\"panel%d\">\n", index);
  absl::StrAppendFormat(&svg,
                        "<text x=\"%.1f\" y=\"%.1f\" font-size=\"15\" font-weight=\"bold\" "
                        "text-anchor=\"middle\">%s</text>\n",
                        (plot_left + plot_right) / 2, top + 18, Escape(panel.title));
  absl::StrAppendFormat(&svg,
                        "<clipPath id=\"plot%d\"><rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" "
                        "height=\"%.1f\"/></clipPath>\n",
                        index, plot_left, plot_top, plot_right - plot_left, kPlotHeight);

  // Grid and tick labels.
  svg += "<g stroke=\"#e3e3e3\" stroke-width=\"1\">\n";
  for (const Tick& tick : x_ticks) {
    absl::StrAppendFormat(&svg, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>\n",
                          sx(tick.value), plot_top, sx(tick.value), plot_bottom);
  }
  for (const Tick& tick : y_ticks) {
    absl::StrAppendFormat(&svg, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>\n",
                          plot_left, sy(tick.value), plot_right, sy(tick.value));
  }
  svg += "</g>\n<g font-size=\"12\" fill=\"#333\">\n";
  for (const Tick& tick : x_ticks) {
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333\"/>"
                          "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n",
                          sx(tick.value), plot_bottom, sx(tick.value), plot_bottom + 5,
                          sx(tick.value), plot_bottom + 19, Escape(tick.label));
  }
  for (const Tick& tick : y_ticks) {
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333\"/>"
                          "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n",
                          plot_left - 5, sy(tick.value), plot_left, sy(tick.value), plot_left - 8,
                          sy(tick.value) + 4, Escape(tick.label));
  }
  svg += "</g>\n";
  absl::StrAppendFormat(&svg,
                        "<text x=\"%.1f\" y=\"%.1f\" font-size=\"13\" text-anchor=\"middle\">%s"
                        "</text>\n",
                        (plot_left + plot_right) / 2, plot_bottom + 40, Escape(panel.x_title));
  absl::StrAppendFormat(&svg,
                        "<text transform=\"translate(%.1f %.1f) rotate(-90)\" font-size=\"13\" "
                        "text-anchor=\"middle\">%s</text>\n",
                        left + 16, (plot_top + plot_bottom) / 2, Escape(panel.y_title));

  // Reference lines, then the series, clipped to the plot.
  absl::StrAppendFormat(&svg, "<g clip-path=\"url(#plot%d)\">\n", index);
  for (const Rule& rule : panel.rules) {
    if (!(rule.y > 0 && std::isfinite(rule.y))) continue;
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#666\" "
                          "stroke-width=\"1.2\" stroke-dasharray=\"10 3 2 3\"/>\n"
                          "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\" fill=\"#555\" "
                          "text-anchor=\"start\">%s</text>\n",
                          plot_left, sy(rule.y), plot_right, sy(rule.y), plot_left + 6,
                          sy(rule.y) - 5, Escape(rule.label));
  }
  for (const Series& series : panel.series) {
    std::string path;
    bool pen_down = false;
    for (const auto& [x, y] : series.points) {
      if (!Drawable(x, y)) {
        pen_down = false;
        continue;
      }
      absl::StrAppendFormat(&path, "%s%.1f %.1f ", pen_down ? "L" : "M", sx(x), sy(y));
      pen_down = true;
    }
    if (!path.empty()) {
      absl::StrAppendFormat(&svg,
                            "<path d=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"%.1f\" "
                            "stroke-linejoin=\"round\"%s/>\n",
                            path, series.color, StrokeWidth(series.style), DashArray(series.style));
    }
    if (series.markers) {
      for (const auto& [x, y] : series.points) {
        if (Drawable(x, y)) svg += Marker(series, sx(x), sy(y));
      }
    }
  }
  svg += "</g>\n";
  absl::StrAppendFormat(&svg,
                        "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
                        "stroke=\"#333\"/>\n",
                        plot_left, plot_top, plot_right - plot_left, kPlotHeight);

  // Legend: two columns, filled top to bottom, then the notes.
  const int rows = LegendRows(panel);
  const double legend_top = plot_bottom + kAxisHeight + 8;
  const double column_width = (plot_right - plot_left) / 2;
  for (size_t i = 0; i < panel.series.size(); ++i) {
    const Series& series = panel.series[i];
    const double x = plot_left + static_cast<double>(static_cast<int>(i) / rows) * column_width;
    const double y = legend_top + static_cast<double>(static_cast<int>(i) % rows) * kLegendRow;
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                          "stroke-width=\"%.1f\"%s/>\n",
                          x, y, x + 34, y, series.color, StrokeWidth(series.style),
                          DashArray(series.style));
    if (series.markers) svg += Marker(series, x + 17, y);
    absl::StrAppendFormat(&svg, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"12\">%s</text>\n", x + 42,
                          y + 4, Escape(series.label));
  }
  double note_y = legend_top + rows * kLegendRow + 6;
  for (const std::string& note : panel.notes) {
    absl::StrAppendFormat(
        &svg, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11.5\" fill=\"#555\">%s</text>\n", plot_left,
        note_y, Escape(note));
    note_y += kNoteRow;
  }
  svg += "</g>\n";
}

}  // namespace

std::string RenderSvg(const Chart& chart) {
  int legend_rows = 0, notes = 0;
  for (const Panel& panel : chart.panels) {
    legend_rows = std::max(legend_rows, LegendRows(panel));
    notes = std::max(notes, static_cast<int>(panel.notes.size()));
  }
  const int panels = std::max(1, static_cast<int>(chart.panels.size()));
  const double width = 2 * kMarginX + panels * kPanelWidth + (panels - 1) * kPanelGap;
  const double height = kHeaderHeight + kPlotTop + kPlotHeight + kAxisHeight + 8 +
                        legend_rows * kLegendRow + 6 + notes * kNoteRow + 10;

  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"%.0f\" height=\"%.0f\" "
      "viewBox=\"0 0 %.0f %.0f\" font-family=\"%s\">\n",
      width, height, width, height, kFont);
  absl::StrAppendFormat(&svg, "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n");
  absl::StrAppendFormat(&svg,
                        "<text x=\"%.1f\" y=\"28\" font-size=\"18\" font-weight=\"bold\" "
                        "text-anchor=\"middle\">%s</text>\n",
                        width / 2, Escape(chart.title));
  absl::StrAppendFormat(&svg,
                        "<text x=\"%.1f\" y=\"50\" font-size=\"12.5\" fill=\"#444\" "
                        "text-anchor=\"middle\">%s</text>\n",
                        width / 2, Escape(chart.subtitle));
  for (size_t i = 0; i < chart.panels.size(); ++i) {
    RenderPanel(svg, chart.panels[i], static_cast<int>(i),
                kMarginX + static_cast<double>(i) * (kPanelWidth + kPanelGap), kHeaderHeight);
  }
  svg += "</svg>\n";
  return svg;
}

}  // namespace attn::cli
